"""The manifest source protocol (parity/capture/sources/manifest_source.py) and its list (sources.py), as
pure logic: what the session does with a source it finds there. The real sources are tested end
to end in test_capture_exec.py, test_graph_manifest.py and test_capture_eager_collectives.py."""

from __future__ import annotations

from parity import records
from parity.capture.sources import registry as sources
from parity.capture.sources.manifest_source import ON_COMPILE, ManifestSource
from parity.capture.session import Session


def test_every_source_is_named_once_and_writes_a_known_source():
    assert len(sources.BY_NAME) == len(sources.SOURCES)
    known = {records.SOURCE_FSDP2, records.SOURCE_GRAPH, records.SOURCE_DTENSOR,
             records.SOURCE_C10D}
    for cls in sources.SOURCES:
        assert issubclass(cls, ManifestSource) and cls.source in known, cls
        assert cls.trigger and cls.unavailable, cls


class _Fake(ManifestSource):
    name = "fake"
    source = "fake-source"
    trigger = ON_COMPILE
    unavailable = "fake manifests unavailable"
    reason: str | None = None
    calls: list[str] = []

    def install(self) -> str | None:
        self.calls.append("install")
        return self.reason

    def uninstall(self) -> None:
        self.calls.append("uninstall")


def _session(tmp_path, monkeypatch, reason):
    monkeypatch.setattr(sources, "SOURCES", (_Fake,))
    monkeypatch.setattr(sources, "BY_NAME", {"fake": _Fake})
    monkeypatch.setattr(_Fake, "reason", reason)
    monkeypatch.setattr(_Fake, "calls", [])
    return Session(tmp_path, lazy=True)


def test_a_reason_is_one_warning_and_the_source_is_not_listed(tmp_path, monkeypatch, capsys):
    s = _session(tmp_path, monkeypatch, "no hook point in this torch")
    s._install_sources(ON_COMPILE)
    s._install_sources(ON_COMPILE)  # tried once per session
    assert _Fake.calls == ["install"]
    assert s.warnings == ["fake manifests unavailable: no hook point in this torch"]
    assert s._capture_meta()["manifests"] == []
    assert capsys.readouterr().err == "parity: fake manifests unavailable: no hook point in this torch\n"


def test_an_installed_source_is_listed_and_uninstalled(tmp_path, monkeypatch):
    s = _session(tmp_path, monkeypatch, None)
    s._install_sources(ON_COMPILE)
    assert s._capture_meta()["manifests"] == ["fake-source"] and s.warnings == []
    s._uninstall()
    assert _Fake.calls == ["install", "uninstall"]
