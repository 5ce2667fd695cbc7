"""Read an offline W&B run (``<run_dir>/wandb/offline-run-*/run-<id>.wandb``) without network.

wandb >= 0.19 no longer ships a Python reader for its transaction log, so this is a small one:
the file is a 7-byte header (``:W&B``, magic, version) followed by LevelDB-log style blocks of
32 KiB, each record a 7-byte header (crc32 of type and chunk, length, type: full/first/middle/
last) and a chunk; the records are ``wandb_internal_pb2.Record`` protobufs. Used by the tests
and to check what a compute node wrote before ``wandb sync``:

    python -m scripts.analysis.wandb_offline results/sweeps/fig3/*/*/wandb/offline-run-*
"""
from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: str | Path):
    """The raw protobuf payloads in a .wandb file, in order.

    W&B's service appends to the file while a run is live (and after ``finish()`` returns), so
    the last record can be torn: its header on disk, its chunk not yet, or not all of it. The
    payloads stop before such a tail. A record whose checksum fails is damage, and an error."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:              # block trailer: zero padding
            pos += left
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and n == 0:       # preallocated zeros
            pos += left
            continue
        start, pos = pos, pos + HEADER + n
        chunk = data[start + HEADER:pos]
        if pos > len(data):            # torn tail: the chunk is not all written yet
            return
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"{path}: bad checksum in the record at byte {start}")
        if kind == 1:                  # full
            yield chunk
        elif kind == 2:                # first
            parts = [chunk]
        elif kind == 3:                # middle
            parts.append(chunk)
        elif kind == 4:                # last
            yield b"".join(parts + [chunk])
        else:
            raise ValueError(f"{path}: bad record type {kind} at byte {start}")


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_offline_run(run_path: str | Path) -> dict:
    """{"id", "project", "group", "job_type", "name", "tags", "config", "history", "summary",
    "metrics", "exit_code"} of one offline run directory or .wandb file."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(run_path)
    if path.is_dir():
        files = sorted(path.glob("run-*.wandb"))
        if not files:
            raise FileNotFoundError(f"no run-*.wandb in {path}")
        path = files[0]
    out = {"config": {}, "history": [], "summary": {}, "metrics": {}, "tags": [],
           "exit_code": None}
    for raw in records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            out.update(id=r.run_id, project=r.project, entity=r.entity, group=r.run_group,
                       job_type=r.job_type, name=r.display_name, notes=r.notes,
                       tags=list(r.tags), resumed=r.resumed)
            out["config"].update({_key(i): json.loads(i.value_json) for i in r.config.update})
        elif kind == "config":
            out["config"].update({_key(i): json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in rec.history.item}
            out["history"].append(row)
        elif kind == "summary":
            out["summary"].update({_key(i): json.loads(i.value_json)
                                   for i in rec.summary.update if _key(i)})
        elif kind == "metric":
            m = rec.metric
            out["metrics"][m.name or m.glob_name] = m.step_metric
        elif kind == "exit":
            out["exit_code"] = rec.exit.exit_code
    out["config"].pop("_wandb", None)
    return out


def main(argv=None) -> None:
    for p in (sys.argv[1:] if argv is None else argv):
        r = read_offline_run(p)
        last = r["history"][-1] if r["history"] else {}
        print(f"{p}: id {r.get('id')} group {r.get('group')} job_type {r.get('job_type')} "
              f"tags {r['tags']} rows {len(r['history'])} exit {r['exit_code']} "
              f"status {r['summary'].get('status')} last {json.dumps(last)}")


if __name__ == "__main__":
    main()
