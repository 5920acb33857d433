#!/usr/bin/env bash
# Every measurement benchmarks/RESULTS.md reports, in one go, on a quiet machine:
#
#     bash benchmarks/run_all.sh [OUT]        # OUT: where the logs and JSON go (default bench-<date>)
#     STAGES="generate shakespeare" bash benchmarks/run_all.sh   # a subset
#
# Stages and their wall time on the 2-core development machine (quiet; about 90 minutes in all):
#   generate      ~3 min   decode tokens/s against transformers, tiny Llama and GPT-2, batch 1 and 8
#   shakespeare   ~15 min  recipe vs the plain-PyTorch yardstick, 2000 steps, seeds 1337 7 42
#   translate-sbs ~8 min   translation tokens/s: recipe vs yardstick_seq2seq.py, 300 steps x 2 rounds
#   translate-10  ~17 min  10 training minutes (greedy BLEU every minute), then averaged checkpoints + beam 4
#   translate-30  ~32 min  30 training minutes (greedy BLEU every 5 minutes), then the same final evaluation
#   precision     ~50 min  shipped LM, MLM and classification recipes in fp32 and bf16 autocast, eager and
#                          compiled, 300 steps x 3 rounds (what `auto` picks; benchmarks/precision.py)
#   precision-translate ~20 min  the same for the translation recipe, 150 steps x 2 rounds
#   mup           ~35 min learning-rate sweeps at widths 64-512, standard vs muP (a study: builder sweep), one
#                         seed; `mup_transfer.py --seed N --also ...` adds seeds (RESULTS.md has the commands)
#   wsd           ~30 min cooldowns branched at 3 points of a warmup-stable-decay run vs cosine, 3 seeds
#   muon          ~55 min Muon vs the tuned AdamW recipes (shakespeare-char, lm-stdlib), 3 seeds
#   (these three measured with OMP_NUM_THREADS=1, two at a time, on the 2-core machine)
# Each stage prints its table or curve and writes OUT/<stage>.log and OUT/<stage>.json; the
# machine line (cores, CPU model, load) is at the top of each log. Nothing else should run on
# the machine meanwhile: every ratio is taken within one stage, but the absolute tokens/s and the
# BLEU reached in a time budget depend on the machine being quiet.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
out=${1:-bench-$(date +%Y%m%d-%H%M)}
stages=${STAGES:-generate shakespeare translate-sbs translate-10 translate-30}
mkdir -p "$out"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python}

run() {  # run STAGE COMMAND...: the command's output to the screen and OUT/STAGE.log; its last line to OUT/STAGE.json
    local stage=$1; shift
    echo "== $stage: $* ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1 /proc/loadavg))"
    local start=$SECONDS
    "$@" 2>&1 | tee "$out/$stage.log"
    tail -n 1 "$out/$stage.log" > "$out/$stage.json"
    echo "== $stage: $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
}

for stage in $stages; do
    case $stage in
        generate) run generate "$py" "$here/generate.py" --json "$out/generate-full.json" ;;
        shakespeare) run shakespeare "$py" "$here/shakespeare_char.py" --seeds 1337 7 42 --json "$out/shakespeare-full.json" ;;
        translate-sbs) run translate-sbs "$py" "$here/translate_multi30k.py" --side-by-side --steps 300 --rounds 2 ;;
        translate-10) run translate-10 "$py" "$here/translate_multi30k.py" --minutes 10 --eval-every 1 \
                          --output-dir "$out/translate-10" ;;
        translate-30) run translate-30 "$py" "$here/translate_multi30k.py" --minutes 30 --eval-every 5 \
                          --output-dir "$out/translate-30" ;;
        precision) run precision "$py" "$here/precision.py" --recipes shakespeare-char lm-stdlib classify bert-mlm \
                       --steps 300 --rounds 3 --json "$out/precision-full.json" ;;
        precision-translate) run precision-translate "$py" "$here/precision.py" --recipes translate-multi30k \
                       --steps 150 --rounds 2 --set eval.max_sentences=100 --set eval.num_beams=1 ;;
        mup) run mup "$py" "$here/mup_transfer.py" --folder "$out/mup" --png "$out/mup_transfer.png" ;;
        wsd) run wsd "$py" "$here/wsd_cooldown.py" --folder "$out/wsd" ;;
        muon) run muon "$py" "$here/muon_vs_adamw.py" --folder "$out/muon" ;;
        *) echo "unknown stage $stage (generate shakespeare translate-sbs translate-10 translate-30 precision" \
                "precision-translate mup wsd muon)" >&2; exit 2 ;;
    esac
done
echo "results in $out"
