"""Dense vs wrapped causal-LM decoding with a KV cache; same as ``condcomp bench decode``.

    python benchmarks/decode.py --model smollm2 --out benchmarks/results/decode_cpu
"""

from __future__ import annotations

import argparse
import sys

from condcomp.bench.decode import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
