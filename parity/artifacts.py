"""The on-disk artifact schema: the one writer capture uses and the one reader everything else uses.

docs/artifacts.md describes the layout; this module (with rundir.py, the folder and file names,
and params_codec.py, the bytes of params.json) is its only implementation. The writer runs
inside training processes, so it is small and does no work beyond formatting and appending
records. The reader reads what a verdict needs first (meta, the steps' roll-ups, each table's
digests, the bucket records) and the table rows and per-parameter hashes only when asked, and it
reads schema 1 (hex hashes in hashes.jsonl) as well as schema 2. It is tolerant: a truncated
last line, a corrupted line or a missing rank is reported in ``problems`` and skipped, never
raised, so a killed job still yields everything it finished.
"""

from __future__ import annotations

import binascii
import contextlib
import gc
import json
import os
import re
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from parity import params_codec
from parity.opt_changes import CHANGES_VERSION, carry_forward, encode
from parity.errors import ArtifactError
from parity.records import is_ends
from parity.rundir import (BUCKETS_FILE, HASHES_FILE, HASHES_V1_FILE, META_FILE, PARAMS_FILE,
                           RUN_FILE, STEPS_FILE, rank_dir, rank_of, refused_records)

if TYPE_CHECKING:  # numpy is imported when per-parameter hashes are read (RankData.hashes)
    import numpy as np

SCHEMA_VERSION = 2
# schema 1: hex hashes in hashes.jsonl, row-per-parameter params.json; 3: a steps.jsonl line
# whose "opt" is changes (opt_changes.py: a reader before it skips the line as damage)
READABLE_VERSIONS = (1, 2, CHANGES_VERSION)
HASH_BYTES = 16  # xxh3-128
NO_HASH = b"\0" * HASH_BYTES  # a parameter with no gradient at that step
# a hashes.bin record: magic, kind (0 param, 1 grad), step, n; then n raw 16-byte hashes
HASH_RECORD = struct.Struct("<4sIqI")
HASH_MAGIC = b"PRH2"
# param: the table after optimizer step k (step 0: before the first); grad: the gradients step
# k consumed; entry: the parameters as step k's optimizer step found them, written only when
# they changed after step k-1's (an edit between step() calls); final: the table when capture
# stopped (the state the trainer ends with), written only when it differs from the last step's
KIND_CODES = {"param": 0, "grad": 1, "entry": 2, "final": 3}
KIND_NAMES = {v: k for k, v in KIND_CODES.items()}
_OFFSET_FIELD = {"param": "param_offset", "grad": "grad_offset", "entry": "entry_offset",
                 "final": "param_offset"}
_DIGEST_FIELD = {"param": "param_digest", "grad": "grad_digest", "entry": "entry_digest",
                 "final": "param_digest"}
FINAL = "final"  # the ``step`` of the final-state line in steps.jsonl
# a figures record (issue 34): the same header with its own magic, then n x 24 bytes: per row
# three little-endian float64, the fp64 sum, the sum of squares and max |x| of the tensor
# Summaries for the size of a difference, never part of a verdict. A row (NaN, -1, NaN) is a
# tensor that was not there (a parameter without a gradient): a sum of squares is never
# negative, so it cannot be a tensor's, not even one holding NaN (whose figures are NaN).
FIGURES_MAGIC = b"PRF2"
FIGURE_FIELDS = ("sum", "sumsq", "max_abs")
FIGURE_BYTES = 8 * len(FIGURE_FIELDS)
NO_FIGURES = struct.pack("<3d", float("nan"), -1.0, float("nan"))


def write_text_atomic(path: str | os.PathLike, data: str) -> None:
    """Write text to a temporary file beside ``path`` and rename it into place: a reader sees
    the old file or the new one, never half of one; a full disk leaves the old file intact.
    What ``write_bytes_atomic`` says of symlinks, pipes and devices holds here too."""
    write_bytes_atomic(path, data.encode())


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """``write_text_atomic`` for bytes.

    A symlink is followed: its target is written (atomically, beside the target), the link
    stays. A path that exists and is no regular file (a FIFO, a character device, a pipe
    behind ``>(jq .)``'s ``/dev/fd/N``) is written in place, opened for writing, never replaced;
    so is an open descriptor (``/dev/stdout``, ``/dev/fd/N``, ``/proc/PID/fd/N``) whatever it
    leads to, appended to (``--json /dev/stderr 2>>log`` adds to the log, as the descriptor
    would). A directory is refused. Failures raise ArtifactError (exit 2) naming ``path``; a
    regular file there is then left as it was."""
    path = Path(path)
    try:
        st = os.stat(path)  # follows symlinks (and /dev/fd/N's links to pipes)
    except FileNotFoundError:
        st = None  # nothing there, or a dangling symlink: its target is created
    except OSError as e:
        raise ArtifactError(f"cannot write {path}: {e.strerror or e}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise ArtifactError(f"cannot write {path}: it is a directory")
    if st is not None and (not stat.S_ISREG(st.st_mode) or _through_descriptor(path)):
        try:
            with open(path, "ab") as f:  # a pipe, a device, a descriptor: written in place
                f.write(data)
        except OSError as e:
            raise ArtifactError(f"cannot write {path}: {e.strerror or e}") from None
        return
    target = Path(os.path.realpath(path))  # a symlink's target; the link itself stays
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            if st is not None:  # keep the mode of the file it replaces
                os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise ArtifactError(f"cannot write {path}: {e.strerror or e}") from None


def _through_descriptor(path: Path) -> bool:
    """Does ``path`` lead, link by link, through a process's open descriptors (``/dev/stdout``
    -> ``/proc/self/fd/1``)? Such a path names a stream, not a file to replace."""
    p = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        if not os.path.islink(p):
            return False
        parent = os.path.dirname(p)
        if re.fullmatch(r"/proc/[^/]+(/task/[^/]+)?/fd", os.path.realpath(parent)):
            return True
        p = os.path.join(parent, os.readlink(p))
    return False


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 1) -> None:
    """Write JSON atomically (see write_text_atomic).

    ``indent=None`` for large objects: an indent makes ``json`` use its pure-Python encoder
    (~10x slower; 70 ms for a 1,500-parameter table).
    """
    try:
        text = json.dumps(obj, indent=indent, sort_keys=False, allow_nan=False)
    except ValueError:  # NaN or infinity somewhere (a NaN loss): not JSON; write null instead
        text = json.dumps(finite_json(obj), indent=indent, sort_keys=False, allow_nan=False)
    write_text_atomic(path, text + "\n")


def finite_json(obj):
    """``obj`` with every NaN or infinite float replaced by None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def rollup_digest(raw_hashes: bytes) -> str:
    """The roll-up of one step's per-parameter hashes (compared before any per-parameter work)."""
    return xxhash.xxh3_128_hexdigest(raw_hashes)


# --------------------------------------------------------------------------- closed-file records
# meta.json's ``closed_files``: each record file's size, times and xxh3-128 as its writer closed
# it. A reader that finds a file as recorded trusts what the writer knew of it (a digest it has
# already parsed, the header digest of params.json, the roll-ups of hashes.bin) instead of
# reading its bytes again; a file changed, copied or touched since is read and checked against
# the recorded digest (a copy reads as intact; an edit, a truncation or a flipped byte is
# damage, said and never compared). This is rsync's quick check, made stricter by the change
# time, which no tool can set back (kernels before Linux 6.13 stamp times from a 1-10 ms tick:
# docs/artifacts.md says what that leaves).
CLOSED_FILES = (PARAMS_FILE, STEPS_FILE, HASHES_FILE, BUCKETS_FILE)


def _stat_record(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _file_digest(path: str) -> tuple[int, str]:
    """(size, xxh3-128 hex) of a file read in chunks (hashes.bin can be large)."""
    h = xxhash.xxh3_128()
    size = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            chunk = os.read(fd, 1 << 24)
            if not chunk:
                break
            h.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return size, h.hexdigest()


def closed_files(rank_folder: str | os.PathLike) -> dict[str, dict]:
    """``{name: {"stat": [size, mtime_ns, ctime_ns], "xxh3": "<32 hex>"}}`` of the files in
    CLOSED_FILES that exist in ``rank_folder``: read back once here, at close, not hashed
    record by record inside the training steps that write them."""
    out: dict[str, dict] = {}
    for name in CLOSED_FILES:
        path = os.path.join(rank_folder, name)
        try:
            st = os.stat(path)
            out[name] = {"stat": _stat_record(st)}
            size, digest = _file_digest(path)
            if size == st.st_size:  # nothing appended in between
                out[name]["xxh3"] = digest
        except OSError:
            continue
    return out


def _recorded_digest(rec) -> str | None:
    """The xxh3 a closed-file record holds, if it is one."""
    d = rec.get("xxh3") if isinstance(rec, dict) else None
    return d if isinstance(d, str) and len(d) == 32 else None


def _as_closed(path: str, rec) -> dict | None:
    """``rec`` (meta.json's record of ``path``) when the file is still as its writer closed
    it, else None."""
    if not isinstance(rec, dict):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return rec if rec.get("stat") == _stat_record(st) else None


class _AppendFile:
    """An append-only file: each record is one ``write`` of complete bytes (a JSON line, or a
    hashes.bin record), so a killed writer leaves at most one partial record, at the end."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "ab", buffering=0)
        self.offset = self._f.seek(0, os.SEEK_END)

    def append_bytes(self, data: bytes) -> int:
        """Append ``data``; return the byte offset at which it starts."""
        start = self.offset
        try:
            n = self._f.write(data)
        except OSError as e:
            raise ArtifactError(f"cannot write {self.path}: {e.strerror or e}") from None
        if n != len(data):
            raise ArtifactError(f"cannot write {self.path}: short write ({n} of {len(data)} bytes)")
        self.offset += n
        return start

    def append(self, record: dict) -> int:
        """Append one JSON line; return the byte offset at which it starts."""
        return self.append_bytes((json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        self._f.close()


class RankWriter:
    """Writes one rank's artifacts incrementally (see docs/artifacts.md)."""

    def __init__(self, out_dir: str | os.PathLike, rank: int, meta: dict):
        self.dir = rank_dir(out_dir, rank)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArtifactError(f"cannot create {self.dir}: {e.strerror or e}") from None
        self.meta = {"v": SCHEMA_VERSION, "rank": rank, **meta}
        self.meta.setdefault("started", time.time())
        self.meta.setdefault("ended", None)
        self.meta.setdefault("status", "running")
        self.meta.setdefault("error", None)
        write_json_atomic(self.dir / META_FILE, self.meta)
        self._hashes = _AppendFile(self.dir / HASHES_FILE)
        self._steps = _AppendFile(self.dir / STEPS_FILE)
        self._opt_last: tuple[int, list[dict]] | None = None  # (step, groups) last written
        self._impl_last: list[dict] | None = None  # the optimizers' classes and flags, likewise
        self._buckets = _AppendFile(self.dir / BUCKETS_FILE)

    def update_meta(self, **updates) -> None:
        self.meta.update(updates)
        write_json_atomic(self.dir / META_FILE, self.meta)

    def write_params(self, params: list[dict]) -> None:
        """The parameter table, in the order every later hash record uses (params_codec)."""
        write_bytes_atomic(self.dir / PARAMS_FILE, params_codec.encode(params))

    def _hash_record(self, step: int, kind: str, raw: bytes) -> tuple[int, str]:
        n = len(raw) // HASH_BYTES
        offset = self._hashes.append_bytes(
            HASH_RECORD.pack(HASH_MAGIC, KIND_CODES[kind], step, n) + raw)
        return offset, rollup_digest(raw)

    def _figures_record(self, step: int, kind: str, raw: bytes) -> int:
        n = len(raw) // FIGURE_BYTES
        return self._hashes.append_bytes(
            HASH_RECORD.pack(FIGURES_MAGIC, KIND_CODES[kind], step, n) + raw)

    def write_step(self, step: int, param_hashes: bytes, grad_hashes: bytes | None = None,
                   loss: float | None = None, loss_hash: str | None = None, *,
                   param_figures: bytes | None = None, grad_figures: bytes | None = None,
                   entry_hashes: bytes | None = None, loss_scale: float | None = None,
                   skipped: str | None = None,
                   rng: dict[str, str] | None = None,
                   opt: list[dict] | None = None,
                   opt_impl: list[dict] | None = None) -> tuple[int, str]:
        """Record one step: ``*_hashes`` are the raw 16-byte hashes concatenated in table order.
        ``*_figures``: the 24-byte figures of the same rows (``FIGURE_FIELDS``), when capture
        computed them: a figures record follows each hash record, and the line gets their
        offsets and one digest of both.
        ``entry_hashes``: the parameters as this step's optimizer step found them, when they
        changed since the previous step's record (an edit between ``step()`` calls);
        ``loss_scale``: the scale of a scaled loss (``loss`` is then the unscaled value);
        ``skipped``: why the optimizer step did not run (``"inf"``: GradScaler found inf/NaN
        gradients); ``rng``: the digests of the default generators' states after the step
        (``{"cpu": hex[, "cuda": hex]}``, capture/rng_state.py); ``opt``: the numbers of the
        param groups of the optimizers that stepped (capture/opt_numbers.py), written as the
        changes since this writer's last line with them (opt_changes.py); ``opt_impl``: their
        classes and flags (capture/opt_impl.py). The optional keys are written only when set,
        so a run without them writes the bytes it always did. Returns (offset, roll-up) of the
        parameter record."""
        entry = None
        if entry_hashes is not None:
            entry = self._hash_record(step, "entry", entry_hashes)
        p_off, p_digest = self._hash_record(step, "param", param_hashes)
        g_off = g_digest = None
        if grad_hashes is not None:
            g_off, g_digest = self._hash_record(step, "grad", grad_hashes)
        line = {"v": SCHEMA_VERSION, "step": step, "param_digest": p_digest,
                "grad_digest": g_digest, "loss": loss, "loss_hash": loss_hash,
                "param_offset": p_off, "grad_offset": g_off}
        if param_figures is not None:
            line["param_figures_offset"] = self._figures_record(step, "param", param_figures)
            both = param_figures
            if grad_figures is not None and grad_hashes is not None:
                line["grad_figures_offset"] = self._figures_record(step, "grad", grad_figures)
                both += grad_figures
            line["figures_digest"] = rollup_digest(both)
        if entry is not None:
            line["entry_offset"], line["entry_digest"] = entry
        if loss_scale is not None:
            line["loss_scale"] = loss_scale
        if skipped is not None:
            line["skipped"] = skipped
        if rng is not None:
            line["rng"] = rng
        changes = False
        if opt is not None:
            since, last = self._opt_last or (None, None)
            line["opt"] = encode(opt, last, since)
            changes = type(line["opt"]) is dict
            if changes:
                line["v"] = CHANGES_VERSION  # a reader before round 15a skips it, said
            self._opt_last = (step, opt)
        if opt_impl is not None:
            # like the numbers: on a line of changes only when it changed (carry_forward gives
            # it back); 1,500 groups' flags were 224 KB a line
            if not (changes and opt_impl == self._impl_last):
                line["opt_impl"] = opt_impl
            self._impl_last = opt_impl
        # no wall time: two runs that train alike write the same bytes (the reader shares them)
        self._steps.append(line)
        return p_off, p_digest

    def write_final(self, after_step: int, hashes: bytes | None = None,
                    same_as: tuple[int, str] | None = None, changed: bool | None = None) -> None:
        """The state the trainer ended with, after step ``after_step``: ``hashes`` (a new
        ``final`` record), or ``same_as`` (offset, roll-up) of that step's parameter record
        when nothing changed since it (no bytes written twice). ``changed``: whether the rows
        the last step recorded changed since (default: a new record was written; a record
        that only adds rows, the optimizers' state, is new but not changed)."""
        if hashes is not None:
            off, digest = self._hash_record(after_step, "final", hashes)
        elif same_as is not None:
            off, digest = same_as
        else:
            raise ValueError("write_final: hashes or same_as")
        self._steps.append({"v": SCHEMA_VERSION, "step": FINAL, "after_step": after_step,
                            "param_digest": digest, "param_offset": off,
                            "changed": hashes is not None if changed is None else changed})

    def write_bucket(self, bucket: dict) -> None:
        self._buckets.append({"v": SCHEMA_VERSION, **bucket})

    def close(self, status: str = "ok", error: str | None = None) -> None:
        for f in (self._hashes, self._steps, self._buckets):
            f.close()
        self.update_meta(status=status, error=error, ended=time.time(),
                         closed_files=closed_files(self.dir))


# --------------------------------------------------------------------------------------- reader

_scan_once = json.decoder.JSONDecoder().scan_once  # one JSON value at an index: no wrapper cost


def _parse_line(line: str):
    """One JSON line (``json.loads`` semantics, without its per-call overhead)."""
    try:
        obj, end = _scan_once(line, 0)
        if end == len(line):
            return obj
    except StopIteration:
        pass
    return json.loads(line)  # leading/trailing blanks, or not JSON: json says which


def _tail_sharing_parser(tail_key: str, memo: dict | None = None):
    """A JSON-line parser for lines whose last key ``tail_key`` holds a long value that repeats
    from line to line (a bucket's entries, recorded again every step): each distinct value is
    parsed once and shared by the records that carry it (read-only, like the bucket lists
    ``_read_lines`` shares between ranks). A line ``{head...,"K":V}`` whose head (closed with
    ``}``) is an object and whose V is JSON is that object with K = V, so the two parses read
    what one would; any other line is parsed whole. ``memo``: the values parsed so far, shared
    by the files of one read (``ReadShare.tails``: ranks whose lines differ only in their
    group's ``ranks`` carry the same entries)."""
    marker = f',"{tail_key}":'
    memo = {} if memo is None else memo

    def parse(line: str):
        i = line.find(marker)
        if i > 0 and line.endswith("}"):
            tail = line[i + len(marker):-1]
            val = memo.get(tail)
            if val is None:
                try:
                    val = memo[tail] = _parse_line(tail)
                except ValueError:
                    val = None
            if val is not None:
                try:
                    head = _parse_line(line[:i] + "}")
                except ValueError:
                    head = None
                if type(head) is dict:
                    head[tail_key] = val
                    return head
        return _parse_line(line)

    return parse


def _read_bytes(path: str | Path, limit: int | None = None) -> bytes:
    """The file's bytes (the first ``limit`` of them). os-level calls: ``open()``'s buffered
    file object costs twice the read of a small file, and a diff reads thousands."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if limit is not None:
            return os.read(fd, limit)
        size = os.fstat(fd).st_size
        data = os.read(fd, size + 1)  # one more byte: a file that grew is read to its end
        if len(data) == size:
            return data
        parts = [data]  # a file that grew or shrank, or a short read (over 2 GiB)
        while data:
            data = os.read(fd, 1 << 24)
            parts.append(data)
        return b"".join(parts)
    finally:
        os.close(fd)


def _share_key(path: str | Path, digest: bytes, size: int) -> bytes:
    """Files of one name (kind) with these bytes: equal keys, equal records."""
    return os.path.basename(path).encode() + b"/" + digest + size.to_bytes(8, "little")


def _read_lines(path: str | Path, problems: list[str], required: tuple[str, ...],
                shared: dict[bytes, list[dict]] | None = None, check=None,
                closed: dict | None = None, tail: str | None = None, record=None,
                damage: list[str] | None = None) -> list[dict]:
    """Every valid record of a JSON-lines file; what is not valid goes to ``problems``.

    With ``shared``, a file whose bytes equal an earlier clean file's returns that file's list
    (the same object: ranks usually write identical bucket manifests). Files are matched by
    length and xxh3-128, the digest every other equality in the schema rests on (Python's own
    bytes hash is ~5x slower). ``closed``: meta.json's record of the file, when the file is as
    its writer closed it (``_as_closed``): its recorded digest finds an earlier equal file
    without reading this one. ``record``: that record whether or not the file is still so;
    bytes that are not the recorded ones, and (in a file its writer closed) a cut last line,
    are damage (``damage``, also said in ``problems``). A line that is not JSON or not of the
    schema is damage wherever it is. ``tail``: the last key of each line, whose values repeat
    (``_tail_sharing_parser``).
    """
    def hurt(msg: str) -> None:
        problems.append(msg)
        if damage is not None:
            damage.append(msg)

    known = None
    if shared is not None and closed is not None and isinstance(closed.get("xxh3"), str):
        try:
            digest = bytes.fromhex(closed["xxh3"])
            known = _share_key(path, digest, closed["stat"][0]) if len(digest) == 16 else None
        except (ValueError, TypeError):
            known = None
        hit = shared.get(known) if known is not None else None
        if hit is not None:
            return hit
    try:
        data = _read_bytes(path)
    except FileNotFoundError:
        problems.append(f"{path}: missing")
        if record is not None and damage is not None:  # its writer closed it: it was there
            damage.append(f"{path}: missing")
        return []
    except OSError as e:
        hurt(f"{path}: unreadable ({e.strerror or e})")
        return []
    key = None
    want = _recorded_digest(record if record is not None else closed)
    if shared is not None or want is not None:
        digest = xxhash.xxh3_128_digest(data)
        key = _share_key(path, digest, len(data))
        if want is not None and digest.hex() != want:
            hurt(f"{path}: its bytes are not those recorded when it was closed (changed after "
                 "its run closed); read as found")
        if shared is not None:
            hit = shared.get(key)
            if hit is not None:
                return hit
    n_problems = len(problems)
    records = []
    try:
        lines = data.decode().split("\n")
        parse = _parse_line if tail is None else _tail_sharing_parser(
            tail, shared.tails.setdefault(tail, {}) if isinstance(shared, ReadShare) else None)
    except UnicodeDecodeError:
        lines, parse = data.split(b"\n"), json.loads
    if lines and lines[-1]:
        cut = len(data) - data.rfind(b"\n") - 1
        msg = f"{path}: last line truncated ({cut} bytes), ignored"
        if record is not None:
            hurt(msg)  # a closed file ends with its last complete line
        else:
            problems.append(msg)  # what a killed writer leaves
    need = frozenset(required)
    for lineno, line in enumerate(lines[:-1], 1):
        try:
            rec = parse(line)
        except (ValueError, UnicodeDecodeError):
            if line.strip():
                hurt(f"{path}:{lineno}: not JSON, skipped")
            continue
        if type(rec) is not dict or rec.get("v") not in READABLE_VERSIONS or not (
                rec.keys() >= need) or (check is not None and not check(rec)):
            hurt(f"{path}:{lineno}: not a schema-{SCHEMA_VERSION} record, skipped")
            continue
        records.append(rec)
    if shared is not None and len(problems) == n_problems:
        shared[key] = records
    return records


def _read_json(path: str | Path, problems: list[str]) -> dict | None:
    try:
        obj = json.loads(_read_bytes(path).decode())
    except FileNotFoundError:
        problems.append(f"{path}: missing")
        return None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        problems.append(f"{path}: unreadable ({e.__class__.__name__})")
        return None
    if not isinstance(obj, dict) or obj.get("v") not in READABLE_VERSIONS:
        problems.append(f"{path}: not a schema-{SCHEMA_VERSION} file")
        return None
    return obj


@dataclass
class Table:
    """What the diff needs of a rank's parameter table before (and usually instead of) its rows:
    ``digest`` (equal digests: the same rows), ``keys`` (equal: the same fqn sequence, so the
    same alignment), ``n`` rows. ``rows`` is filled on first use (``RankData.params``)."""

    digest: str
    keys: str
    n: int
    version: int
    rows: list[dict] | None = None
    data: bytes | None = field(default=None, repr=False)  # the checked bytes, until decoded


def _read_table(path: str | Path, problems: list[str], closed: dict | None = None,
                record=None, damage: list[str] | None = None) -> Table | None:
    """A rank's params.json: schema 2 is checked by its digest and not parsed; schema 1 is
    parsed (its digest: of its bytes). ``closed`` (the file is as its writer closed it,
    ``_as_closed``): only a schema-2 header is read; the rows' bytes are read, and checked
    against the header's digest, if they are ever needed (``RankData.params``). A table read
    whole is also checked against ``record`` (meta.json's record of it at close: bytes not
    those recorded are damage) and its ``keys`` against its ``fqn`` column. What is wrong goes
    to ``problems`` and ``damage``; such a table is not compared (None)."""
    def hurt(msg: str) -> None:
        problems.append(msg)
        if damage is not None:
            damage.append(msg)

    if closed is not None:
        try:
            head = _read_bytes(path, params_codec.HEADER_BYTES)
            if params_codec.is_v2(head):
                digest, n, keys = params_codec.read_header(head, verify=False)
                return Table(digest, keys, n, 2)
        except (OSError, ValueError):
            pass  # read and checked whole below, which says what is wrong
    try:
        data = _read_bytes(path)
    except FileNotFoundError:
        problems.append(f"{path}: missing")
        if record is not None and damage is not None:
            damage.append(f"{path}: missing")
        return None
    except OSError as e:
        hurt(f"{path}: unreadable ({e.strerror or e})")
        return None
    want = _recorded_digest(record)
    changed = (f"{path}: its bytes are not those recorded when it was closed (changed after "
               "its run closed); not compared")
    if params_codec.is_v2(data):
        try:
            digest, n, keys = params_codec.read_header(data)
            params_codec.check_keys(params_codec.fqn_column(data), n, keys)
        except (ValueError, UnicodeDecodeError) as e:
            hurt(f"{path}: {e}; not compared")
            return None
        if want is not None and xxhash.xxh3_128_hexdigest(data) != want:
            hurt(changed)
            return None
        return Table(digest, keys, n, 2, data=data)
    if want is not None and xxhash.xxh3_128_hexdigest(data) != want:
        hurt(changed)
        return None
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        hurt(f"{path}: unreadable ({e.__class__.__name__})")
        return None
    if not isinstance(obj, dict) or obj.get("v") != 1:
        hurt(f"{path}: not a schema-{SCHEMA_VERSION} file")
        return None
    rows = obj.get("params") if isinstance(obj.get("params"), list) else []
    rows = [p for p in rows if isinstance(p, dict) and isinstance(p.get("fqn"), str)]
    for p in rows:
        p.pop("index", None)  # the row's position, which schema 2 does not repeat
    # equal bytes, equal rows (the digest of a schema-2 table is never equal to it: a mixed
    # pair compares the rows themselves)
    digest = "v1:" + xxhash.xxh3_128_hexdigest(data)
    return Table(digest, params_codec.keys_digest([p["fqn"] for p in rows]), len(rows), 1, rows)


@dataclass
class RankData:
    """One rank's artifacts. The parameter table is parsed and per-parameter hashes are read
    lazily, only when asked (``params``, ``hashes``): a diff whose roll-ups and table digests
    agree reads neither.

    ``buckets`` may be the very list of another rank (of this run or, in a diff, of the other
    side) when both ranks' buckets.jsonl are byte-identical (the usual case), and the records
    in ``steps`` those of the other side's rank when both steps.jsonl are (two runs that train
    alike): treat them as read-only, and ``params`` likewise.
    """

    rank: int
    path: Path
    meta: dict
    steps: dict[int, dict]
    buckets: list[dict]
    problems: list[str] = field(default_factory=list)
    table: Table | None = None

    @property
    def params(self) -> list[dict]:
        """The parameter table's rows ([] when there is none or it cannot be read)."""
        t = self.table
        if t is None:
            return []
        if t.rows is None:
            t.rows = self._decode_table(t)
        return t.rows

    @property
    def n_params(self) -> int:
        return 0 if self.table is None else self.table.n

    @property
    def table_digest(self) -> str | None:
        return None if self.table is None else self.table.digest

    @property
    def keys_digest(self) -> str | None:
        return None if self.table is None else self.table.keys

    def _decode_table(self, t: Table) -> list[dict]:
        """The rows of the bytes whose digest was checked when the rank was read (a live run
        may have rewritten the file since), or, for a table read by its header only, of the
        file as it is now when its digest is still the header's."""
        data, t.data = t.data, None
        if data is None:
            path = self.path / PARAMS_FILE
            try:
                data = _read_bytes(path)
                digest = params_codec.read_header(data)[0]
            except (OSError, ValueError) as e:
                why = e.strerror if isinstance(e, OSError) else e
                self.problems.append(f"{path}: {why}; not compared")
                return []
            if digest != t.digest:
                self.problems.append(f"{path}: rewritten since it was read; not compared")
                return []
        try:
            rows = params_codec.decode(data)
            if len(rows) != t.n:
                raise ValueError(f"{len(rows)} rows, its header says {t.n}")
            return rows
        except (ValueError, UnicodeDecodeError) as e:  # a writer bug: the bytes are as written
            self.problems.append(f"{self.path / PARAMS_FILE}: table unreadable ({e}); "
                                 "not compared")
            return []
    # processes that also claimed this rank and were not recorded (rundir.refused_records)
    refused: list[dict] = field(default_factory=list)
    # the final-state line of steps.jsonl (``"step": "final"``): the table when capture stopped
    final: dict | None = None
    # what of this rank's records is damaged (also in ``problems``): a file changed after its
    # run closed, a record that cannot be read or fails its checksum, a missing meta.json.
    # The diff makes a pair with any of it incomplete, whether or not the verdict needed it.
    damage: list[str] = field(default_factory=list)
    # the ``ends`` lines of buckets.jsonl (parity.records.ENDS: where a source's sequence of
    # buckets got shorter), kept out of ``buckets``: only reduction_steps.records_at reads them
    bucket_ends: list[dict] = field(default_factory=list)

    @property
    def fqns(self) -> list[str]:
        return [p["fqn"] for p in self.params]

    def hashes(self, step: int, kind: str = "param") -> np.ndarray | None:
        """Per-parameter hashes of one step as an (n, 16) uint8 array, or None if absent/bad.
        ``kind``: ``param``, ``grad``, ``entry`` (the parameters as step ``step``'s optimizer
        step found them; None when they had not changed since step ``step - 1``: see
        ``entry_hashes``) or ``final`` (the final state; ``step`` is ignored). The bytes read
        must have the roll-up steps.jsonl recorded: a corrupted record is reported and not
        compared, never taken for a divergence."""
        if kind == "final":
            rec = self.final
            step = rec.get("after_step") if rec is not None else None
        else:
            rec = self.steps.get(step)
        if rec is None:
            return None
        offset = rec.get(_OFFSET_FIELD[kind])
        if not isinstance(offset, int):
            return None
        v1 = rec.get("v") == 1
        fname = HASHES_V1_FILE if v1 else HASHES_FILE
        try:
            if v1:
                hrec, raw = _parse_hash_line(self._read_line(fname, offset))
                r_step, r_kind = hrec.get("step"), hrec.get("kind")
            else:
                r_step, r_kind, raw = self._read_record(offset)
        except (OSError, ValueError, KeyError, TypeError):
            self.problems.append(f"{self.path / fname}: step {step} {kind} record unreadable")
            return None
        # a final state equal to its last step's refers to that step's parameter record
        kinds = ("final", "param") if kind == "final" else (kind,)
        if r_step != step or r_kind not in kinds or len(raw) % HASH_BYTES:
            self.problems.append(f"{self.path / fname}: step {step} {kind} record mismatched")
            return None
        want = rec.get(_DIGEST_FIELD[kind])
        if isinstance(want, str) and rollup_digest(raw) != want:
            self.problems.append(f"{self.path / fname}: step {step} {kind} hashes do not have "
                                 f"the roll-up steps.jsonl recorded (corrupted); not compared")
            return None
        n = len(raw) // HASH_BYTES
        # an entry record is taken before the rows that join at its step are added
        cut = step - 1 if kind == "entry" else step
        if n < self.n_params and all(
                isinstance(p.get("since"), int) and p["since"] > cut for p in self.params[n:]):
            # parameters that joined the optimizers after this step: not recorded yet (NO_HASH)
            raw += NO_HASH * (len(self.params) - n)
        import numpy as np

        return np.frombuffer(raw, dtype=np.uint8).reshape(-1, HASH_BYTES)

    def figures(self, step: int, kind: str = "param") -> np.ndarray | None:
        """Per-parameter figures of one step (``FIGURE_FIELDS``: fp64 sum, sum of squares,
        max |x|) as an (n, 3) float64 array, rows of ``NO_FIGURES`` where there was no tensor
        (padded likewise for rows that joined later); None when the step has
        none (a run captured before figures existed) or they are damaged (reported: the bytes
        must have the line's ``figures_digest``). Summaries for the size of a difference: the
        verdict never reads them."""
        got = self._figures.get(step)
        if got is None:
            got = self._figures[step] = self._read_figures(step)
        arr = got.get(kind)
        if arr is None:
            return None
        n = arr.shape[0]
        if n < self.n_params and all(
                isinstance(p.get("since"), int) and p["since"] > step for p in self.params[n:]):
            import numpy as np

            pad = np.frombuffer(NO_FIGURES * (self.n_params - n), dtype="<f8")
            arr = np.concatenate([arr, pad.reshape(-1, len(FIGURE_FIELDS))])
        return arr

    def _read_figures(self, step: int) -> dict:
        rec = self.steps.get(step)
        if rec is None or not isinstance(rec.get("param_figures_offset"), int):
            return {}
        raw: dict[str, bytes] = {}
        try:
            for kind in ("param", "grad"):
                off = rec.get(f"{kind}_figures_offset")
                if not isinstance(off, int):
                    continue
                r_step, r_kind, data = self._read_record(off, FIGURES_MAGIC, FIGURE_BYTES)
                if r_step != step or r_kind != kind:
                    raise ValueError("mismatched")
                raw[kind] = data
        except (OSError, ValueError):
            self.problems.append(f"{self.path / HASHES_FILE}: step {step} figures record "
                                 "unreadable; sizes of differences not shown")
            return {}
        if rollup_digest(b"".join(raw.values())) != rec.get("figures_digest"):
            self.problems.append(f"{self.path / HASHES_FILE}: step {step} figures do not have "
                                 "the digest steps.jsonl recorded (corrupted); not shown")
            return {}
        import numpy as np

        return {k: np.frombuffer(v, dtype="<f8").reshape(-1, len(FIGURE_FIELDS))
                for k, v in raw.items()}

    _figures: dict = field(default_factory=dict, repr=False, compare=False)
    def entry_hashes(self, step: int) -> np.ndarray | None:
        """The parameters as step ``step``'s optimizer step found them: its ``entry`` record
        when capture wrote one, else (nothing changed after step ``step - 1``) that step's
        parameter record. Buffer rows are zero either way: a buffer changes in the forward pass
        by design (BatchNorm statistics), so only parameters say whether the trainer edited the
        model between ``step()`` calls."""
        rec = self.steps.get(step)
        if rec is None:
            return None
        if isinstance(rec.get("entry_offset"), int):
            return self.hashes(step, "entry")
        h = self.hashes(step - 1, "param")
        if h is None:
            return None
        buffers = [i for i, p in enumerate(self.params[:len(h)]) if p.get("kind") == "buffer"]
        if buffers:
            h = h.copy()
            h[buffers] = 0
        return h

    _read_hint: int = field(default=1 << 16, repr=False, compare=False)

    def _read_line(self, fname: str, offset: int) -> bytes:
        """The line at ``offset``, usually in one read (a rank's lines have one length)."""
        with open(self.path / fname, "rb", buffering=0) as f:
            f.seek(offset)
            buf = f.read(self._read_hint)
            end = buf.find(b"\n")
            while end < 0:
                more = f.read(max(len(buf), 1 << 16))
                if not more:
                    raise ValueError("line without end")
                start = len(buf)
                buf += more
                end = buf.find(b"\n", start)
        self._read_hint = end + 64
        return buf[:end]

    def _read_record(self, offset: int, want: bytes = HASH_MAGIC,
                     row_bytes: int = HASH_BYTES) -> tuple[int, str, bytes]:
        """(step, kind, payload) of the hashes.bin record at ``offset``: a hash record, or with
        ``FIGURES_MAGIC`` / ``FIGURE_BYTES`` a figures record."""
        with open(self.path / HASHES_FILE, "rb", buffering=0) as f:
            f.seek(offset)
            buf = f.read(max(self._read_hint, HASH_RECORD.size))
            if len(buf) < HASH_RECORD.size:
                raise ValueError("record cut short")
            magic, code, step, n = HASH_RECORD.unpack_from(buf)
            if magic != want or code not in KIND_NAMES:
                raise ValueError("not a hash record")
            size = HASH_RECORD.size + n * row_bytes
            if len(buf) < size:
                buf += f.read(size - len(buf))
                if len(buf) < size:
                    raise ValueError("record cut short")
        self._read_hint = size
        return step, KIND_NAMES[code], buf[HASH_RECORD.size:size]


def _parse_hash_line(line: bytes) -> tuple[dict, bytes]:
    """A schema-1 hashes.jsonl line: (record without "hashes", raw hash bytes). The writer put
    "hashes" last, so the 32*n hex characters are sliced and decoded without a JSON pass over
    them; any other layout goes through ``json``."""
    key = line.rfind(b'"hashes":"')
    if key > 0 and line.endswith(b'"}') and line[key - 1:key] == b",":
        head = json.loads(line[:key - 1] + b"}")
        if isinstance(head, dict) and "hashes" not in head:
            return head, binascii.unhexlify(line[key + 10:-2])
    rec = json.loads(line)
    return rec, bytes.fromhex(rec["hashes"])


@dataclass
class Run:
    """A run directory: run-level metadata and each rank's data."""

    path: Path
    run_meta: dict | None
    ranks: dict[int, RankData]
    problems: list[str]

    @property
    def world_size(self) -> int | None:
        for r in self.ranks.values():
            ws = r.meta.get("world_size")
            if isinstance(ws, int):
                return ws
        return None

    @property
    def missing_ranks(self) -> list[int]:
        ws = self.world_size
        if ws is None:
            return []
        return [r for r in range(ws) if r not in self.ranks]

    def step_numbers(self) -> list[int]:
        """Steps complete on every rank present."""
        sets = [set(r.steps) for r in self.ranks.values()]
        return sorted(set.intersection(*sets)) if sets else []

    def steps_frame(self):
        import pandas as pd

        rows = [
            {"rank": r.rank, "step": s, "param_digest": rec.get("param_digest"),
             "grad_digest": rec.get("grad_digest"), "loss": rec.get("loss"),
             "loss_hash": rec.get("loss_hash")}
            for r in self.ranks.values() for s, rec in sorted(r.steps.items())
        ]
        return pd.DataFrame(rows, columns=["rank", "step", "param_digest", "grad_digest", "loss",
                                           "loss_hash"])

    def buckets_frame(self):
        """One row per bucket entry (the layout table the diff and reports share)."""
        import pandas as pd

        rows = []
        for r in self.ranks.values():
            for b in r.buckets:
                entries = b.get("entries") if isinstance(b, dict) else None
                for pos, e in enumerate(entries if isinstance(entries, list) else ()):
                    if not isinstance(e, dict):  # a damaged record (the diff names it)
                        continue
                    rows.append({
                        "rank": r.rank, "source": b.get("source"), "collective": b.get("collective"),
                        "graph": b.get("graph"), "graph_id": b.get("graph_id"), "step": b.get("step"),
                        "index": b.get("index"), "group": b.get("group"), "position": pos,
                        "fqn": e.get("fqn"), "offset": e.get("offset"), "size": e.get("size"),
                        "numel": e.get("numel"), "dtype": e.get("dtype"),
                        "shape": tuple(e.get("shape") or ()),
                    })
        return pd.DataFrame(rows, columns=["rank", "source", "collective", "graph", "graph_id",
                                           "step", "index", "group", "position", "fqn", "offset",
                                           "size", "numel", "dtype", "shape"])


@contextlib.contextmanager
def gc_paused():
    """Parsing JSON builds millions of acyclic objects; the cyclic collector would rescan them
    over and over (a 256-rank run read in 19 s instead of 2.5 s)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _check_records(base: str, steps: dict[int, dict], final: dict | None, record,
                   problems: list[str], damage: list[str]) -> set[tuple]:
    """Every hash record steps.jsonl refers to, checked against its roll-up: the (step, kind)
    keys whose record cannot be read or does not have its roll-up (said in ``problems`` and
    ``damage``). ``record``: meta.json's record of hashes.bin at close; a file whose bytes
    are those is not parsed record by record (a copy of a run reads as intact)."""
    path = base + HASHES_FILE
    want = _recorded_digest(record)
    refs = []
    for s, rec in steps.items():
        for kind in ("param", "grad", "entry"):
            off = rec.get(_OFFSET_FIELD[kind])
            if isinstance(off, int) and not isinstance(off, bool):
                refs.append((s, kind, rec))
    off = final.get("param_offset") if final is not None else None
    if isinstance(off, int) and not isinstance(off, bool):
        refs.append((FINAL, "final", final))
    if not refs and want is None:
        return set()
    v1 = [x for x in refs if x[2].get("v") == 1]
    refs = [x for x in refs if x[2].get("v") != 1]
    data = b""
    if refs or want is not None:
        try:
            data = _read_bytes(path)
        except FileNotFoundError:
            data = None
        except OSError as e:
            msg = f"{path}: unreadable ({e.strerror or e})"
            problems.append(msg)
            damage.append(msg)
            return {(s, k) for s, k, _ in refs}
    if data is None:
        if refs or record is not None:
            msg = f"{path}: missing; {len(refs)} record(s) not compared"
            problems.append(msg)
            damage.append(msg)
        return {(s, k) for s, k, _ in refs}
    if want is not None and xxhash.xxh3_128_hexdigest(data) == want and not v1:
        return set()  # the bytes closed: every roll-up was computed from them
    bad: dict[tuple, str] = {}
    for s, kind, rec in refs:
        off = rec[_OFFSET_FIELD[kind]]
        step = rec.get("after_step") if kind == "final" else s
        end = off + HASH_RECORD.size
        if off < 0 or end > len(data):
            bad[(s, kind)] = "record unreadable (cut short)"
            continue
        magic, code, r_step, n = HASH_RECORD.unpack_from(data, off)
        kinds = ("final", "param") if kind == "final" else (kind,)
        if magic != HASH_MAGIC or code not in KIND_NAMES:
            bad[(s, kind)] = "record unreadable (not a hash record)"
            continue
        if KIND_NAMES[code] not in kinds or r_step != step:
            bad[(s, kind)] = "record mismatched"
            continue
        raw = data[end:end + n * HASH_BYTES]
        if len(raw) < n * HASH_BYTES:
            bad[(s, kind)] = "record unreadable (cut short)"
        elif rollup_digest(raw) != rec.get(_DIGEST_FIELD[kind]):
            bad[(s, kind)] = _ROLLUP_FAILS
    fig_bad = _check_figures(data, steps) if refs else []
    data1 = None
    if v1:  # schema 1: hex lines in hashes.jsonl, read once
        try:
            data1 = _read_bytes(base + HASHES_V1_FILE)
        except OSError:
            data1 = b""
    for s, kind, rec in v1:
        try:
            off = rec[_OFFSET_FIELD[kind]]
            end = data1.find(b"\n", off)
            if off < 0 or end < 0:
                raise ValueError("line without end")
            hrec, raw = _parse_hash_line(data1[off:end])
            if hrec.get("step") != s or hrec.get("kind") != kind:
                bad[(s, kind)] = "record mismatched"
            elif rollup_digest(raw) != rec.get(_DIGEST_FIELD[kind]):
                bad[(s, kind)] = _ROLLUP_FAILS
        except (OSError, ValueError, KeyError, TypeError, binascii.Error):
            bad[(s, kind)] = "record unreadable"
    if bad:
        first = sorted(bad, key=lambda x: (x[0] == FINAL, x[0] if x[0] != FINAL else 0, x[1]))
        shown = ", ".join(f"{'final state' if s == FINAL else f'step {s}'} {k} {bad[(s, k)]}"
                          for s, k in first[:3])
        msg = (f"{path}: {len(bad)} damaged record(s) ({shown}"
               f"{', ...' if len(bad) > 3 else ''}); not compared")
        problems.append(msg)
        damage.append(msg)
    if fig_bad:
        msg = (f"{path}: {len(fig_bad)} damaged figures record(s) ({', '.join(fig_bad[:3])}"
               f"{', ...' if len(fig_bad) > 3 else ''}); sizes of differences not shown there")
        problems.append(msg)
        damage.append(msg)
    elif not bad and want is not None and not v1:
        msg = (f"{path}: its bytes are not those recorded when it was closed (changed after its "
               "run closed; every record steps.jsonl refers to still checks)")
        problems.append(msg)
        damage.append(msg)
    return set(bad)


def _check_figures(data: bytes, steps: dict[int, dict]) -> list[str]:
    """Every figures record steps.jsonl refers to (``*_figures_offset``), checked against the
    line's ``figures_digest``: what is damaged, in words ("step 3 record cut short"). Figures
    are never part of a verdict, but damage anywhere in a run is said."""
    out = []
    for s, rec in steps.items():
        if rec.get("v") == 1 or not isinstance(rec.get("param_figures_offset"), int):
            continue
        raw, why = b"", None
        for kind in ("param", "grad"):
            off = rec.get(f"{kind}_figures_offset")
            if not isinstance(off, int) or isinstance(off, bool):
                continue
            end = off + HASH_RECORD.size
            if off < 0 or end > len(data):
                why = "record cut short"
                break
            magic, code, r_step, n = HASH_RECORD.unpack_from(data, off)
            if magic != FIGURES_MAGIC or KIND_NAMES.get(code) != kind or r_step != s:
                why = "not its figures record"
                break
            body = data[end:end + n * FIGURE_BYTES]
            if len(body) < n * FIGURE_BYTES:
                why = "record cut short"
                break
            raw += body
        if why is None and rollup_digest(raw) != rec.get("figures_digest"):
            why = "figures do not have the digest steps.jsonl recorded"
        if why is not None:
            out.append(f"step {s} {why}")
    return out


_UNVERIFIED_LOSS = {"loss": None, "loss_hash": None}
_ROLLUP_FAILS = "hashes do not have the roll-up steps.jsonl recorded (corrupted)"


def read_rank(path: Path, rank: int, _shared: dict[bytes, list[dict]] | None = None) -> RankData:
    """One rank folder: meta.json, the table's digests (params.json), the steps' roll-ups and
    the bucket records; per-parameter hashes and table rows wait until asked for.

    Damage is looked for in every file whether or not a verdict will need it: a file that is
    as its writer closed it (meta.json ``closed_files``: size, times) is trusted without
    reading; any other is read and checked (against the recorded digest, else record by
    record). A step whose hash record is damaged is dropped (not compared); a steps.jsonl
    changed after close keeps only the steps whose roll-ups its hash records confirm, without
    their losses (which nothing else confirms)."""
    problems: list[str] = []
    damage: list[str] = []
    base = os.path.join(path, "")  # plain strings: pathlib's joins cost more than the reads
    meta = _read_json(base + META_FILE, problems)
    if meta is None:
        damage.append(problems[-1] + ": its status, capture warnings, hasher and closed-file "
                      "records are unknown")
        meta = {}
    closed = meta.get("closed_files")
    closed = closed if isinstance(closed, dict) else {}
    table = _read_table(base + PARAMS_FILE, problems,
                        _as_closed(base + PARAMS_FILE, closed.get(PARAMS_FILE)),
                        closed.get(PARAMS_FILE), damage)
    steps: dict[int, dict] = {}
    final = None
    steps_closed = _as_closed(base + STEPS_FILE, closed.get(STEPS_FILE))
    n_damage = len(damage)
    lines = _read_lines(base + STEPS_FILE, problems, ("step", "param_digest"), _shared,
                        closed=steps_closed, record=closed.get(STEPS_FILE), damage=damage)
    steps_changed = len(damage) > n_damage
    # the group numbers written as changes (opt_changes.py), in file order, before any step is
    # dropped below or renumbered by --align-steps
    for rec in carry_forward(lines):
        s = rec["step"]
        if isinstance(s, int) and not isinstance(s, bool):
            steps[s] = rec
        elif s == FINAL and isinstance(rec.get("after_step"), int):
            final = rec
    if final is not None and steps and max(steps) > final["after_step"]:
        final = None  # an earlier torchelastic attempt's: this attempt went on past it
    hashes_closed = _as_closed(base + HASHES_FILE, closed.get(HASHES_FILE))
    if steps_closed is None or hashes_closed is None:
        bad = _check_records(base, steps, final, closed.get(HASHES_FILE), problems, damage)
        if bad or steps_changed:
            steps = {s: rec for s, rec in steps.items()
                     if not any((s, k) in bad for k in ("param", "grad", "entry"))}
            if final is not None and (FINAL, "final") in bad:
                final = None
            if steps_changed:  # the losses are not confirmed by anything: not compared
                steps = {s: {**rec, **_UNVERIFIED_LOSS} for s, rec in steps.items()}
    buckets = _read_lines(base + BUCKETS_FILE, problems,
                          ("source", "collective", "index", "entries"), _shared,
                          check=lambda b: isinstance(b["entries"], list), tail="entries",
                          closed=_as_closed(base + BUCKETS_FILE, closed.get(BUCKETS_FILE)),
                          record=closed.get(BUCKETS_FILE), damage=damage)
    if problems and problems[-1] == f"{base}{BUCKETS_FILE}: missing":
        problems.pop()  # a run without bucket manifests (--no-manifests, or none issued)
    said = meta.get("rank")
    if isinstance(said, int) and not isinstance(said, bool) and said != rank:
        # A directory renamed, copied or swapped: its hashes belong to another rank.
        problems.append(f"{path}: meta.json says rank {said}, the directory rank {rank} "
                        "(swapped or copied directories?); not compared")
        table, steps, final = None, {}, None
    buckets, ends = _split_ends(buckets, _shared)
    return RankData(rank, path, meta, steps, buckets, problems, table, refused_records(path),
                    final, damage, ends)


def _split_ends(buckets: list[dict], _shared: dict | None) -> tuple[list[dict], list[dict]]:
    """(the bucket records, the ``ends`` lines) of one rank's buckets.jsonl. A list shared by
    ranks with byte-identical files is split once and its parts shared alike (``ReadShare``);
    a list without ``ends`` lines (the usual case) comes back as it is."""
    memo = getattr(_shared, "ends", None)
    got = None if memo is None else memo.get(id(buckets))
    if got is not None and got[0] is buckets:
        return got[1], got[2]
    if any(map(is_ends, buckets)):
        out = ([b for b in buckets if not is_ends(b)], [b for b in buckets if is_ends(b)])
    else:
        out = (buckets, [])
    if memo is not None:
        memo[id(buckets)] = (buckets, *out)  # the list itself is kept: its id stays its own
    return out


class ReadShare(dict):
    """What the reads of one diff share: the records of byte-identical files by their key
    (``_read_lines``: ranks usually write identical bucket manifests, and ranks that trained
    alike identical steps), and in ``ends`` each shared bucket list's split into records and
    ``ends`` lines, so that ranks sharing a list share its parts too; in ``tails`` the values
    of each line's last key parsed so far (a bucket's entries: ``_tail_sharing_parser``), so
    that files which are not byte-identical (each rank's lines name its own group's ``ranks``)
    share their entries' parse and checks."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: dict[int, tuple[list[dict], list[dict], list[dict]]] = {}
        self.tails: dict[str, dict[str, object]] = {}


def read_run(path: str | os.PathLike, _shared: dict | None = None) -> Run:
    """Read a run directory. Raises ArtifactError only when it is not a parity run at all.
    ``_shared``: pass one ``ReadShare`` to the reads of two runs to share the records of their
    byte-identical files too (the diff: bucket records, and the step records of ranks that
    trained alike)."""
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path}: no such directory")
    if not path.is_dir():
        raise ArtifactError(f"{path}: not a directory")
    problems: list[str] = []
    run_meta = None
    if (path / RUN_FILE).exists():
        run_meta = _read_json(path / RUN_FILE, problems)
    ranks: dict[int, RankData] = {}
    try:
        children = sorted(path.iterdir())
    except OSError as e:
        raise ArtifactError(f"{path}: unreadable ({e.strerror or e})") from None
    shared: dict[bytes, list[dict]] = ReadShare() if _shared is None else _shared
    with gc_paused():
        for child in children:
            r = rank_of(child.name)
            if r is not None and child.is_dir():
                rd = read_rank(child, r, shared)
                ranks[rd.rank] = rd
                problems.extend(rd.problems)
    if not ranks:
        if run_meta is not None:
            status = run_meta.get("status")
            raise ArtifactError(
                f"{path}: the run recorded no rank data (run status {status!r}, "
                f"exit code {run_meta.get('exit_code')!r})"
            )
        hint = ""  # a sweep's cell or the sweep itself given where a run was expected
        if (Path(path) / "cell.json").is_file():
            hint = (f"; it is a sweep cell: compare its sides with `parity diff "
                    f"{Path(path) / 'reference'} {Path(path) / 'candidate'}`")
        elif (Path(path) / "sweep.json").is_file():
            hint = f"; it is a sweep directory: `parity report {path}` or `parity gate {path}`"
        raise ArtifactError(f"{path}: not a parity run directory (no rank-NNNNN/ folders){hint}")
    return Run(path, run_meta, ranks, problems)
