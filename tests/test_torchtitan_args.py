"""torchtitan's batch flags in the installed torchtitan's spelling (issue 22, item 1), without
torchtitan: main's field names come from a fake config package written here (no network)."""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass, fields

import pytest

from parity.errors import SpecError
from parity.sweep import torchtitan_args as ta
from parity.sweep.spec import parse_spec

OLD_ARGS = ["-m", "torchtitan.train", "--module", "llama3", "--training.steps", "10",
            "--training.local_batch_size", "16", "--training.seq_len", "8192", "--debug.seed", "42"]


@dataclass
class TrainingConfig:  # torchtitan main's names (torchtitan/config/configs.py, Nov 2026)
    num_tokens_per_microbatch_per_dp_rank: int = 8192
    max_context_length: int = 8192
    num_tokens_per_train_step: int = -1
    steps: int = 10000


@dataclass
class Training:  # torchtitan 0.3.0's names
    local_batch_size: int = 8
    seq_len: int = 2048
    steps: int = 10000


def test_spelling_from_the_config_dataclass_fields():
    assert ta.spelling_from_fields(f.name for f in fields(TrainingConfig)) == "new"
    assert ta.spelling_from_fields(f.name for f in fields(Training)) == "old"
    assert ta.spelling_from_fields(["steps"]) is None


def test_old_spelling_rewritten_for_main():
    out = ta.adapt(OLD_ARGS, "new")
    assert out == ["-m", "torchtitan.train", "--module", "llama3", "--training.steps", "10",
                   "--training.num_tokens_per_microbatch_per_dp_rank", "131072",
                   "--training.max_context_length", "8192", "--debug.seed", "42"]
    assert ta.adapt(out, "old") == ["-m", "torchtitan.train", "--module", "llama3",
                                    "--training.steps", "10", "--training.local_batch_size", "16",
                                    "--training.seq_len", "8192", "--debug.seed", "42"]
    assert ta.adapt(OLD_ARGS, "old") == OLD_ARGS  # already right
    assert ta.adapt(OLD_ARGS, None) == OLD_ARGS  # unknown torchtitan: as written
    dashed = ["--training.local-batch-size=2", "--training.seq-len=256"]
    assert ta.adapt(dashed, "new") == ["--training.num_tokens_per_microbatch_per_dp_rank", "512",
                                       "--training.max_context_length", "256"]


def test_untranslatable_is_one_line():
    with pytest.raises(SpecError, match="not a multiple"):
        ta.adapt(["--training.num_tokens_per_microbatch_per_dp_rank", "100",
                  "--training.max_context_length", "64"], "old", "c1 reference: ")
    with pytest.raises(SpecError, match="without --training.seq_len"):
        ta.adapt(["--training.local_batch_size", "2"], "new")


def _fake_torchtitan(root, source):
    pkg = root / "torchtitan"
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("")
    (pkg / "config" / "configs.py").write_text(textwrap.dedent(source))
    return root


def test_installed_main_found_from_its_field_names(tmp_path, monkeypatch):
    root = _fake_torchtitan(tmp_path, """
        from dataclasses import dataclass

        @dataclass(kw_only=True, slots=True)
        class TrainingConfig:
            num_tokens_per_microbatch_per_dp_rank: int = 8192
            max_context_length: int = 8192
            steps: int = 10000
        """)
    for name in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(ta, "_CACHE", {})
    monkeypatch.syspath_prepend(str(root))
    found = ta.installed(None)
    assert found.spelling == "new" and str(root) in found.where
    # a spec written with 0.3.0's flags generates main's
    spec = parse_spec(textwrap.dedent("""
        name = "t"
        [axes.batch_size]
        values = [1, 16]
        [axes.batch_size.flags]
        1 = ["--training.local_batch_size", "1", "--training.seq_len", "8192"]
        16 = ["--training.local_batch_size", "16", "--training.seq_len", "8192"]
        [reference]
        argv = ["-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_8b"]
        [candidate]
        argv = ["-m", "torchtitan.train", "--module", "graph_trainer.llama3"]
        """))
    argv = spec.cells()[1].sides["candidate"].entry_argv
    assert argv[-4:] == ["--training.num_tokens_per_microbatch_per_dp_rank", "131072",
                         "--training.max_context_length", "8192"]


def test_non_torchtitan_commands_untouched():
    argv = ["-m", "parity.workloads.train", "--steps", "3"]
    assert not ta.is_torchtitan(argv)
    assert ta.adapt_for_installed(argv, None) == argv
