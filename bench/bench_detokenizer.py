"""What streaming a long output costs the server's event loop: ``IncrementalDetokenizer`` over the
embedded tokenizer, a long text's ids sent in chunks (one chunk per stream per host sync), windowed
(only the ids since the last complete text decoded) against its unwindowed path (every pending id
decoded at every chunk, which tokenizers that clean up spaces need). Host only; no device.

    python3 bench/bench_detokenizer.py --lengths 1024,4096,8192 --chunk 8
    python3 bench/bench_detokenizer.py --lone-bytes --chunk 1     # one undecodable byte id, over and over
"""

from __future__ import annotations

import argparse
import time

import timing
from dflash_jax import embedded
from dflash_jax.io.tokenizer import IncrementalDetokenizer, Tokenizer


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> str:
    return "".join(detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)) + detok.finish()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--chunk", type=int, default=8, help="ids per chunk (a host sync's tokens for one stream)")
    ap.add_argument("--lone-bytes", action="store_true",
                    help="the ids: one id that decodes to a lone UTF-8 lead byte, repeated (text never completes)")
    ap.add_argument("--out", default=None, help="JSON rows (seconds per length and path)")
    args = ap.parse_args()
    tokenizer = Tokenizer(embedded.DEFAULT_TARGET)
    if args.lone_bytes:
        ids = [next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i], False) == "\ufffd")]
    else:
        ids = tokenizer.encode("\n".join(embedded.heldout_prompts()), add_special_tokens=False)
    print("ids | windowed: ms, us per chunk | every id decoded: ms, us per chunk")
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        sample = (ids * (n // len(ids) + 1))[:n]
        row, rows = [], rows + [{"ids": n, "chunk": args.chunk, "lone_bytes": args.lone_bytes}]
        for windowed in (True, False):
            detok = IncrementalDetokenizer(tokenizer)
            detok._windowed = windowed  # this instance's path, for the comparison
            t0 = time.perf_counter()
            out = stream(detok, sample, args.chunk)
            seconds = time.perf_counter() - t0
            assert out == tokenizer.decode(sample)  # sanity: streamed text is the whole decode
            rows[-1]["windowed_s" if windowed else "unwindowed_s"] = seconds
            row.append(f"{seconds * 1e3:.1f}, {seconds / (n / args.chunk) * 1e6:.0f}")
        print(f"{n} | {row[0]} | {row[1]}")
    timing.write_json(args.out, rows)


if __name__ == "__main__":
    main()
