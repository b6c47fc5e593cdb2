"""The ``--importance`` flag of ``condcomp calibrate-kv`` and ``condcomp bench kv``: static pruning's group importance.

Three files of this project hold per-(layer, KV group) numbers, and only one of them is read by ``--importance``:

- ``static_importance.json`` (``condcomp tune-llm``): a JSON object with ``group_importance``. Accepted.
- a KV gates file (``condcomp calibrate-kv --method duo`` or ``--method importance``): read by ``--evaluate``,
  ``--init duo --duo-gates`` and bench kv's ``split-duo`` variants.
- a per-request router file (``.pt``, ``condcomp calibrate-kv --method request``): read by ``--evaluate`` and bench
  kv's ``split-request`` variants.

:func:`importance_file` checks the kind when the command line is parsed and names the file's kind when it is not
the accepted one. A path that does not exist is passed on: the commands compute the importance, or say it is
missing, themselves.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ACCEPTED = ("--importance takes static pruning's group importance: the static_importance.json that condcomp "
            "tune-llm writes (a JSON object with 'group_importance')")


def importance_file(value: str | Path) -> Path:
    """An argparse ``type``: ``value`` as a path, refused when it names a file of another kind."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; {ACCEPTED}")
    if not path.is_file():
        return path
    raw = path.read_bytes()
    if raw[:2] == b"PK":  # torch.save's zip container
        raise argparse.ArgumentTypeError(
            f"{path} is a torch file (a per-request router file of calibrate-kv --method request?), not JSON; "
            f"{ACCEPTED}. A router file goes to calibrate-kv --evaluate")
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(f"{path} is not a JSON file ({err}); {ACCEPTED}") from None
    if isinstance(record, dict) and "group_importance" in record:
        return path
    from condcomp.experiments.llm.duo_gates import FORMAT as GATES_FORMAT

    if isinstance(record, dict) and record.get("format") == GATES_FORMAT:
        raise argparse.ArgumentTypeError(
            f"{path} is a KV gates file (method {record.get('method')!r}, written by condcomp calibrate-kv); "
            f"{ACCEPTED}. A gates file goes to calibrate-kv --evaluate or --init duo --duo-gates, and to bench kv's "
            "split-duo variants as results/kv/duo_gates.json")
    kind = f"a JSON object with keys {sorted(record)[:6]}" if isinstance(record, dict) else "JSON but not an object"
    raise argparse.ArgumentTypeError(f"{path} holds {kind}; {ACCEPTED}")
