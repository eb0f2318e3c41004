#!/usr/bin/env bash
# The commands behind bench/results/ (run from the repository root on a quiet machine; each
# prints its table and the SHA-256 of the raw JSON it writes). LLAMA_CPP: a llama.cpp source
# tree matching the installed llama-cpp-python (docs/benchmarks.md, "llama.cpp as a peer"); without it the
# peers report says llama.cpp was not run.
set -euo pipefail
R=bench/results
mkdir -p $R
python -m pytest -q -p no:cacheprovider bench/test_bench_kernels.py --benchmark-only --benchmark-group-by=group \
  --benchmark-columns=median,min,max --benchmark-json=$R/kernels.json | tee $R/kernels.txt
python bench/tokens_per_cycle.py --max-tokens 64 --out $R/tokens_per_cycle.json | tee $R/tokens_per_cycle.txt
sapwood bench ab --a verify=off --b verify=chain --max-tokens 128 --blocks 12 --processes 5 --out $R/ab_off_vs_chain.json | tee $R/ab_off_vs_chain.txt
sapwood bench ab --a verify=chain --b verify=auto --max-tokens 128 --blocks 12 --processes 5 --out $R/ab_chain_vs_auto.json | tee $R/ab_chain_vs_auto.txt
sapwood bench ab --a verify=off --b verify=auto --max-tokens 128 --blocks 12 --processes 5 --out $R/ab_off_vs_auto.json | tee $R/ab_off_vs_auto.txt
# (removed with the plain fallback, issue 39) python bench/replay_fallback.py record --out $R/fallback_rounds.json > /dev/null
# (removed with the plain fallback, issue 39) python bench/replay_fallback.py replay $R/fallback_rounds.json --verbose | tee $R/fallback_replay.txt
# the 2-core Xeon's recording of stop 18 (chain rounds ~4.75 plain tokens): policy changes are
# replayed on both machines' rounds
# (removed with the plain fallback, issue 39) python bench/replay_fallback.py replay $R/fallback_rounds_xeon.json --verbose | tee $R/fallback_replay_xeon.txt
# and the 2-core Zen 3 (AVX2 only, no VNNI) of stop 27, where verify(9) costs ~5.8 verify(1)
# (removed with the plain fallback, issue 39) python bench/replay_fallback.py replay $R/fallback_rounds_zen3_avx2.json --verbose | tee $R/fallback_replay_zen3_avx2.txt
GGUF=()
if [ -n "${LLAMA_CPP:-}" ]; then
  for t in q8_0 f32; do
    python scripts/convert_gguf.py python/sapwood/data/default/target "$LLAMA_CPP" --outtype $t \
      --outfile /tmp/sapwood-default-$t.gguf > /dev/null 2>&1
    GGUF+=(/tmp/sapwood-default-$t.gguf)
  done
fi
sapwood bench peers --reps 6 ${GGUF[@]:+--gguf "${GGUF[@]}"} --out $R/peers.json | tee $R/peers.txt
sapwood bench width --depths 0 2048 8192 32768 --reps 6 --max-tokens 64 --out $R/width.json | tee $R/width.txt
python bench/realistic.py --weights q8 --contexts 64 4096 --reps 6 --json $R/realistic.json | tee $R/realistic.txt
# The bundled pair with its target padded to a realistic cost (same function bit for bit;
# README "Speculation at a realistic cost"), and the policy replays recorded on it
P=$R/padded
mkdir -p $P
python scripts/pad_checkpoint.py default /tmp/padded --intermediate 8192 --layers 32
for ab in "verify=off verify=chain,drafter=default off_vs_chain" "verify=chain,drafter=default verify=auto,drafter=default chain_vs_auto" \
          "verify=off verify=auto,drafter=default off_vs_auto"; do
  set -- $ab
  sapwood bench ab --model /tmp/padded --a $1 --b $2 --max-tokens 64 --blocks 4 --processes 3 --out $P/ab_$3.json | tee $P/ab_$3.txt
done
sapwood bench width --model /tmp/padded --drafter default --depths 0 2048 --reps 4 --max-tokens 64 --out $P/width.json | tee $P/width.txt
python bench/replay_width.py record --model /tmp/padded --depths 1 2048 --out $P/replay_depths.json
python bench/replay_width.py replay $P/replay_depths.json --requests 8 | tee $P/replay_depths.txt
python bench/replay_width.py record --model /tmp/padded --depths --cohort 13 --out $P/replay_cohort.json
python bench/replay_width.py replay $P/replay_cohort.json --widths "" --shared --requests 4 | tee $P/replay_cohort_shared.txt
# Stop 30: the first request of a fresh rule, paired with the best fixed width, 8 pairs a depth;
# the unpadded cohort recorded for deterministic replays; the fallback's recording
for dw in "1 5" "2048 3" "8192 3"; do
  set -- $dw
  python bench/first_request.py --model /tmp/padded --depth $1 --width $2 --pairs 8
done | tee $P/first_request.txt
python bench/replay_width.py record --model default --cohort 13 --max-tokens 128 --out $R/replay_cohort_unpadded.json
python bench/replay_width.py replay $R/replay_cohort_unpadded.json --widths "" --shared --requests 4 --max-tokens 128 --python-ms 0.15
# (removed with the plain fallback, issue 39) python bench/replay_fallback.py record --out $R/fallback_rounds_stop30.json
# (removed with the plain fallback, issue 39) python bench/replay_fallback.py replay $R/fallback_rounds_stop30.json
# Stop 31: a held-out recording (depths 512 and 4096, the 30 held-out prompts), the replay suite
# over every recording, the host's verify noise at 2K, the live width study and first requests
python bench/replay_width.py record --model /tmp/padded --depths 512 4096 --prompts bench/heldout_prompts.json \
    --prompts-n 30 --out $P/replay_heldout.json
python bench/replay_suite.py --quiet
python bench/verify_noise.py --model /tmp/padded --depth 2048 --out $P/verify_noise_2k.json
sapwood bench width --model /tmp/padded --drafter default --depths 0 2048 8192 --reps 4 --max-tokens 64 \
    --out $P/width_fd05b60.json | tee $P/width_fd05b60.txt
for dw in "2048 3" "1 5" "8192 3"; do  # alternate with the previous build's copy (first_request.py)
  set -- $dw
  python bench/first_request.py --model /tmp/padded --depth $1 --width $2 --pairs 8
done | tee -a $P/first_request_old_new2.txt
for ab in "verify=chain verify=auto chain_auto" "verify=off verify=auto off_auto"; do
  set -- $ab
  sapwood bench ab --a $1 --b $2 --max-tokens 128 --blocks 4 --processes 3 --out $R/stop31_$3_8b1cae9.json \
      | tee $R/stop31_$3_8b1cae9.txt
done
sapwood bench ab --model /tmp/padded --a verify=chain,drafter=default --b verify=auto,drafter=default \
    --max-tokens 64 --blocks 4 --processes 3 --out $P/ab_chain_auto_8b1cae9.json | tee $P/ab_chain_auto_8b1cae9.txt
# Stop 32: the row cap A/B'd in one process on one _core against the previous Python (no
# build: git archive), the replay suite, the live width study, the padded and unpadded A/Bs
mkdir -p /tmp/old /tmp/new && git archive 13428b4 python/sapwood | tar -x -C /tmp/old --strip-components 1
cp -r python/sapwood /tmp/new/ && cp "$(python -c 'import sapwood._core as c; print(c.__file__)')" /tmp/new/sapwood/
python bench/ab_builds.py /tmp/old /tmp/new --in-process --share-core --model /tmp/padded --drafter default \
    --modes chain,auto --max-tokens 64 --blocks 2 | tee $P/ab_row_cap.txt
python bench/replay_suite.py --quiet
sapwood bench width --model /tmp/padded --drafter default --depths 0 2048 8192 --reps 4 --max-tokens 64 \
    --out $P/width_rowcap.json | tee $P/width_rowcap.txt
sapwood bench ab --model /tmp/padded --a verify=chain,drafter=default --b verify=auto,drafter=default \
    --max-tokens 64 --blocks 4 --processes 3 --out $P/ab_chain_auto_a24dee2.json | tee $P/ab_chain_auto_a24dee2.txt
sapwood bench ab --a verify=off --b verify=auto --max-tokens 128 --blocks 4 --processes 3 \
    --out $R/stop32_off_auto_a24dee2.json | tee $R/stop32_off_auto_a24dee2.txt
for ab in "verify=chain verify=auto chain_auto" "verify=off verify=chain off_chain"; do
  set -- $ab
  sapwood bench ab --a $1 --b $2 --max-tokens 128 --blocks 4 --processes 3 --out $R/stop32_$3_a24dee2.json \
      | tee $R/stop32_$3_a24dee2.txt
done
for dw in "2048 3" "1 5" "8192 4"; do  # the fixed width's own first request beside the rule's
  set -- $dw
  python bench/first_request.py --model /tmp/padded --depth $1 --width $2 --pairs 8
done | tee $P/first_request_fresh_fixed.txt  # at 59fea75
sapwood bench width --model /tmp/padded --drafter default --depths 0 2048 8192 --reps 4 --max-tokens 64 \
    --out $P/width_59fea75.json | tee $P/width_59fea75.txt
# Issue 39: one policy. Recordings on a 2-core Zen 4 (AVX-512 VNNI), engine on one thread (the
# host was shared with four builds and test runs: two threads' barrier stalled), and the
# replay suite over both hosts' recordings, this policy and the one before it side by side
Z=bench/results/zen4_vnni
mkdir -p $Z/padded
python bench/replay_width.py record --threads 1 --model /tmp/padded --depths 1 2048 8192 --out $Z/padded/replay_depths.json
python bench/replay_width.py record --threads 1 --model /tmp/padded --depths --cohort 13 --out $Z/padded/replay_cohort.json
python bench/replay_width.py record --threads 1 --model default --depths --cohort 13 --max-tokens 128 --out $Z/replay_cohort_unpadded.json
python bench/replay_width.py record --threads 1 --model default --depths 1 2048 8192 --out $Z/replay_depths_unpadded.json
python bench/replay_suite.py --quiet | tee $Z/replay_suite.txt
python bench/replay_suite.py --quiet --old cb6175b | tee $Z/replay_suite_old_cb6175b.txt
# Issue 39, stop 41: recordings on a 2-core Xeon with AVX-512 and AMX (engine on one thread; the
# bundled pair with 25 repetitions per timing), and the suite over three hosts, 5 exploration
# seeds, the policy before the host's level and after it
X=bench/results/xeon_amx
mkdir -p $X/padded
python bench/replay_width.py record --threads 1 --reps 25 --model default --depths 1 2048 8192 --out $X/replay_depths_unpadded.json
python bench/replay_width.py record --threads 1 --model /tmp/padded --depths 1 2048 8192 --out $X/padded/replay_depths.json
python bench/replay_width.py record --threads 1 --reps 25 --model default --depths --cohort 13 --max-tokens 128 --out $X/replay_cohort_unpadded.json
python bench/replay_width.py record --threads 1 --model /tmp/padded --depths --cohort 13 --out $X/padded/replay_cohort.json
python bench/replay_width.py record --threads 1 --reps 25 --model default --depths 32768 --out $X/replay_depth32k_unpadded.json
python bench/replay_width.py record --threads 1 --model /tmp/padded --depths 32768 --out $X/padded/replay_depth32k.json
python bench/replay_suite.py --quiet --seeds 5 --table --old be85a1f~1 | tee $X/replay_suite_seeds5_old.txt
python bench/replay_suite.py --quiet --seeds 5 --table | tee $X/replay_suite_seeds5.txt
# Issue 48: streaming load on a 2-core Zen 4 (AVX-512 VNNI); random checkpoints of the
# published shapes in scratch space (about 25 GB of disk for the three)
Z4=bench/results/zen4_vnni/load
for size in 0.8B 2B 9B; do python scripts/make_checkpoint.py $size /tmp/qwen35-${size,,}; done
python bench/load.py /tmp/qwen35-0.8b /tmp/qwen35-2b --weights q8 q4 bf16 f32 --reps 3 --out $Z4/load_0.8b_2b.json | tee $Z4/load_0.8b_2b.txt
python bench/load.py /tmp/qwen35-9b --weights q4 q8 --reps 2 --out $Z4/load_9b.json | tee $Z4/load_9b.txt
