"""Dense vs k-head oracle vs masked vs gathered attention; same as ``condcomp bench attention``.

    python benchmarks/attention.py --device cpu --out results/bench_attention_cpu
"""

from __future__ import annotations

import argparse
import sys

from condcomp.bench.attention import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
