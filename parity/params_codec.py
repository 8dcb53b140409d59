"""params.json of schema 2: one rank's parameter table as self-checked column JSON.

Bytes in, bytes out: parity/artifacts.py reads and writes the file (docs/artifacts.md). A table
is written once per rank (again only when parameters join later) and read by every diff, so the
format is made for the reader: a diff of 256 ranks should not parse 256 tables to learn that
they are the ones it has already seen.

    {"v":2,"digest":"<32 hex>","n":1500,"keys":"<32 hex>","columns":{"fqn":[...],...}}

* ``digest``: xxh3-128 of every byte after ``"digest":"<32 hex>",`` to the end of the file (its
  newline included). A reader checks a table with one hash of its bytes instead of a parse, and
  two tables with equal digests hold the same rows.
* ``keys``: xxh3-128 of the ``fqn`` column's JSON (``keys_digest``). Ranks whose tables list the
  same names in the same order align the same way, so the diff parses one table per distinct
  key sequence, not one per rank. A reader that reads a table whole checks ``keys`` against
  the column (``check_keys``): the digest alone would accept names edited with it.
* ``columns``: one entry per row key, ``fqn`` first, the others in order of first appearance;
  each is a list (one value per row) or an object:
  ``{"all": v}`` every row has the value v; ``{"fqn_prefix": p}`` every row's value is p followed
  by its fqn (``raw_fqn`` of a compiled module: ``_orig_mod.``); ``{"rows": [i, ...],
  "values": [...]}`` only rows i have the key (``kind`` of buffers, ``since`` of late joiners).
"""

from __future__ import annotations

import json

import xxhash

VERSION = 2
PREFIX = b'{"v":2,"digest":"'
_DIGEST_END = len(PREFIX) + 32
_BODY = _DIGEST_END + 2  # after '",'
_COLUMNS = b',"columns":'
HEADER_BYTES = 256  # v, digest, n and keys: ~130 bytes


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


def keys_digest(fqns: list[str]) -> str:
    """The ``keys`` of a table whose ``fqn`` column is ``fqns`` (also computed for schema-1
    tables, so that runs of either schema align alike)."""
    return xxhash.xxh3_128_hexdigest(_dumps(fqns).encode())


def _column(key: str, rows: list[dict], fqns: list[str]):
    idx = [i for i, r in enumerate(rows) if key in r]
    vals = [rows[i][key] for i in idx]
    if len(idx) < len(rows):
        return {"rows": idx, "values": vals}
    first = _dumps(vals[0])
    if _dumps(vals) == "[" + ",".join([first] * len(vals)) + "]":  # one encoder call
        return {"all": vals[0]}
    if all(type(v) is str for v in vals) and vals[0].endswith(fqns[0]):
        p = vals[0][:len(vals[0]) - len(fqns[0])]
        if all(v == p + f for v, f in zip(vals, fqns)):
            return {"fqn_prefix": p}
    return vals


def encode(rows: list[dict]) -> bytes:
    """The bytes of params.json for ``rows`` (each a dict with a str ``fqn``), in row order."""
    fqns = [r["fqn"] for r in rows]
    columns: dict = {"fqn": fqns}
    if rows:
        for r in rows:
            for k in r:
                if k not in columns:
                    columns[k] = None
        for k in list(columns)[1:]:
            columns[k] = _column(k, rows, fqns)
    body = (f'"n":{len(rows)},"keys":"{keys_digest(fqns)}","columns":{_dumps(columns)}}}\n'
            ).encode()
    return PREFIX + xxhash.xxh3_128_hexdigest(body).encode() + b'",' + body


def is_v2(data: bytes) -> bool:
    return data.startswith(PREFIX)


def read_header(data: bytes, verify: bool = True) -> tuple[str, int, str]:
    """(digest, n, keys) of a schema-2 table after checking its digest; ValueError saying what
    is wrong otherwise. The columns are not parsed. ``verify=False``: ``data`` may be the
    file's first bytes only (HEADER_BYTES hold the header), and the digest is not checked (the
    caller knows the file is as its writer closed it)."""
    body = data[_BODY:]
    digest = data[len(PREFIX):_DIGEST_END]
    if data[_DIGEST_END:_BODY] != b'",' or (
            verify and xxhash.xxh3_128_hexdigest(body).encode() != digest):
        raise ValueError("its digest does not match its bytes (truncated or corrupted)")
    k = body.find(_COLUMNS)
    try:
        head = json.loads(b"{" + body[:k] + b"}") if k > 0 else None
    except (ValueError, UnicodeDecodeError):
        head = None
    n = head.get("n") if isinstance(head, dict) else None
    keys = head.get("keys") if isinstance(head, dict) else None
    if type(n) is not int or n < 0 or not isinstance(keys, str):
        raise ValueError("its header is not n and keys")
    return digest.decode(), n, keys


_FQN_COLUMN = '"columns":{"fqn":'
_decoder = json.JSONDecoder()


def fqn_column(data: bytes) -> list[str]:
    """The ``fqn`` column of a schema-2 table, parsed alone (the writer puts it first, so the
    other columns are not parsed); ValueError when it is not a list of names."""
    text = data.decode()
    i = text.find(_FQN_COLUMN)
    if i < 0:
        raise ValueError("no fqn column")
    fqns, _ = _decoder.raw_decode(text, i + len(_FQN_COLUMN))
    if not isinstance(fqns, list) or not all(type(f) is str for f in fqns):
        raise ValueError("the fqn column is not a list of names")
    return fqns


def check_keys(fqns: list[str], n: int, keys: str) -> None:
    """ValueError unless ``fqns`` are ``n`` names whose ``keys_digest`` is the header's
    ``keys``: a table whose digest was recomputed after an edit of its names (or of ``keys``)
    would otherwise align its hashes by names it does not hold."""
    if len(fqns) != n:
        raise ValueError(f"its fqn column has {len(fqns)} names, its header says {n}")
    if keys_digest(fqns) != keys:
        raise ValueError("its keys do not match its fqn column (edited?)")


def decode(data: bytes) -> list[dict]:
    """The rows of a schema-2 table (whose digest was checked); ValueError if they do not
    decode (a writer bug: the bytes are what was written)."""
    obj = json.loads(data)
    n, cols = obj.get("n"), obj.get("columns")
    if type(n) is not int or not isinstance(cols, dict):
        raise ValueError("no columns")
    fqns = cols.get("fqn")
    if not isinstance(fqns, list) or len(fqns) != n or not all(type(f) is str for f in fqns):
        raise ValueError("the fqn column is not n names")
    keys = obj.get("keys")
    if isinstance(keys, str):
        check_keys(fqns, n, keys)
    rows = [{"fqn": f} for f in fqns]
    for k, c in cols.items():
        if k == "fqn":
            continue
        if isinstance(c, list) and len(c) == n:
            for r, v in zip(rows, c):
                r[k] = v
        elif isinstance(c, dict) and c.keys() == {"all"}:
            v = c["all"]
            for r in rows:
                r[k] = v
        elif isinstance(c, dict) and c.keys() == {"fqn_prefix"} and type(c["fqn_prefix"]) is str:
            p = c["fqn_prefix"]
            for r in rows:
                r[k] = p + r["fqn"]
        elif (isinstance(c, dict) and c.keys() == {"rows", "values"}
              and isinstance(c["rows"], list) and isinstance(c["values"], list)
              and len(c["rows"]) == len(c["values"])
              and all(type(i) is int and 0 <= i < n for i in c["rows"])):
            for i, v in zip(c["rows"], c["values"]):
                rows[i][k] = v
        else:
            raise ValueError(f"column {k!r} is not one of the encodings")
    return rows
