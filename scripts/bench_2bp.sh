#!/usr/bin/env bash
# The 2BP stage measurements in one command: `jaxhybrid bench stage` on each stage the goal
# names, one JSON object per line (also appended to $OUT/bench_2bp.jsonl when OUT is set).
#
#   scripts/bench_2bp.sh            CPU set: gpt-small-cpu stages (middle at mb 2/4/8, first, last),
#                                   the tiny.yaml job, LLaMA stages (llama-small-cpu middle and
#                                   last, a 2-block llama-tiny), and 2-block stages at GPT-2 small's
#                                   width (d 768: gpt2-small at 2 and 4 x 256 tokens, a LLaMA of
#                                   that width at 2 x 256)
#   scripts/bench_2bp.sh --widths   gpt-small-cpu's 4-block middle stage at 4 x 128 tokens, widened
#                                   (d 128/256/384/512/768, d_ff 4d): the ratio against stage width
#   scripts/bench_2bp.sh --gpu      GPU set: 4-block middle stages of GPT-2 small and GPT-2 1.3B in
#                                   bf16, 8 x 1024 tokens (cuDNN attention), fused vs split, TFLOP/s;
#                                   a 2-block stage of 2BP's own LLaMA-style Transformer-7b, 4 x 1024
#
# Extra arguments go to every `bench stage` call (e.g. --repeats 5). Python: $PYTHON if set, else the
# project's .venv (made by scripts/setup.sh), else a python3 that already has jax (a GPU image).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
set_name=cpu
case "${1:-}" in --gpu) set_name=gpu; shift ;; --widths) set_name=widths; shift ;; esac
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"
elif [ -x .venv/bin/python ]; then py=.venv/bin/python
elif python3 -c "import jax, flax" >/dev/null 2>&1; then py=python3
else bash scripts/setup.sh; py=.venv/bin/python
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

# A LLaMA (llama-small-cpu: RMSNorm, RoPE, GQA, SwiGLU) at GPT-2 small's width; llama-small-cpu's 2 kv heads.
llama768="--set model.name=llama-small-cpu --set model.d_model=768 --set model.n_heads=12 --set model.d_ff=2048"
if [ "$set_name" = widths ]; then
  cases=()
  for d in 128 256 384 512 768; do
    cases+=("--set model.name=gpt-small-cpu --set model.d_model=$d --set model.n_heads=$((d / 64 > 4 ? d / 64 : 4)) --set model.d_ff=$((4 * d)) --microbatch-size 4 --seq-len 128")
  done
elif [ "$set_name" = gpu ]; then
  cases=(
    "--model gpt2-small --blocks 4 --dtype bfloat16 --microbatch-size 8 --seq-len 1024"
    "--model gpt2-1.3b --blocks 4 --dtype bfloat16 --microbatch-size 8 --seq-len 1024"
    "--model gpt2-1.3b --blocks 4 --dtype bfloat16 --microbatch-size 2 --seq-len 1024"
    "--model 2bp-transformer-7b --blocks 2 --dtype bfloat16 --microbatch-size 4 --seq-len 1024"
  )
else
  cases=(
    "--microbatch-size 2"
    "--microbatch-size 4"
    "--microbatch-size 8"
    "--blocks 0:4"
    "--blocks 4:8"
    "--config configs/runs/tiny.yaml"
    "--model llama-small-cpu"
    "--model llama-small-cpu --blocks 4:8"
    "--model llama-tiny --blocks 2"
    "--model gpt2-small --blocks 2 --microbatch-size 2 --seq-len 256"
    "--model gpt2-small --blocks 2 --microbatch-size 4 --seq-len 256"
    "$llama768 --blocks 2 --microbatch-size 2 --seq-len 256"
  )
fi
lines=()
failed=()
[ -n "${OUT:-}" ] && mkdir -p "$OUT"
for c in "${cases[@]}"; do
  # A case that fails is named at the end and the rest still run (a lent GPU's minutes are few); each
  # result is written as soon as it exists, so a run cut short keeps what it measured.
  # shellcheck disable=SC2086  # each case is a list of words
  if ! line="$("$py" -m jaxhybrid bench stage --json $c "$@" | tail -n 1)" || [ -z "$line" ]; then
    echo "bench_2bp: case failed: $c" >&2
    failed+=("$c")
    continue
  fi
  echo "$line"
  lines+=("$line")
  if [ -n "${OUT:-}" ]; then printf '%s\n' "$line" >> "$OUT/bench_2bp.jsonl"; fi
done
[ "${#lines[@]}" -gt 0 ] || { echo "bench_2bp: every case failed" >&2; exit 1; }
# One row per stage: the goal's ratio with its per-round quartiles, the same two passes each synchronised
# on its own ("per call": a second call's fixed host cost added; "cold" and "warm" are timed so too), a
# trivial call's cost ("noop ms"), the host's time to enqueue the fused pass and the split's two ("enq f/s
# ms"), the split's flops and bytes over the fused pass's by XLA's count ("xla fl", "xla by"; n/a on a GPU),
# and achieved TFLOP/s.
printf '%s\n' "${lines[@]}" > "${TMPDIR:-/tmp}/bench_2bp.$$.jsonl"
"$py" - "${TMPDIR:-/tmp}/bench_2bp.$$.jsonl" <<'PY'
import json, sys
rows = [json.loads(ln) for ln in open(sys.argv[1])]
xla = lambda r: "   n/a" if r is None else f"{r:6.3f}"  # null off the CPU: XLA's count misses library calls
enq = lambda t: f"{t['backward_fused'] * 1e3:.2f}/{(t['backward_input'] + t['backward_weight']) * 1e3:.2f}"
print(f"{'model':>15} {'d':>4} {'blocks':>6} {'mb x T':>9} {'dtype':>8} {'fused ms':>9} {'split/fused':>11} "
      f"{'round iqr':>13} {'per call':>8} {'cold':>6} {'warm':>6} {'queued':>7} {'noop ms':>7} {'enq f/s ms':>11} {'concat':>7} {'xla fl':>6} {'xla by':>6} "
      f"{'bwd TFLOP/s':>11}")
for d in rows:
    (lo, hi), (q1, q3) = d["blocks"], d["split_over_fused_rounds_iqr"]
    shape, blocks, iqr = f"{d['microbatch_size']}x{d['seq_len']}", f"{lo}:{hi}", f"{q1:.3f}-{q3:.3f}"
    print(f"{d['model']:>15} {d['d_model']:>4} {blocks:>6} {shape:>9} {d['dtype']:>8} {d['backward_fused_s'] * 1e3:9.2f} "
          f"{d['split_over_fused']:11.3f} {iqr:>13} {d['split_over_fused_per_call']:8.3f} {d['split_over_fused_cold']:6.3f} {d['split_over_fused_warm']:6.3f} "
          f"{d['split_over_fused_queued']:7.3f} {d['noop_call_s'] * 1e3:7.3f} {enq(d['dispatch_s']):>11} "
          f"{d['split_concat_over_fused']:7.3f} {xla(d['split_flops_over_fused'])} {xla(d['split_bytes_over_fused'])} "
          f"{d['backward_fused_tflops']:11.2f}")
PY
rm -f "${TMPDIR:-/tmp}/bench_2bp.$$.jsonl"
if [ "${#failed[@]}" -gt 0 ]; then
  printf 'bench_2bp: failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
