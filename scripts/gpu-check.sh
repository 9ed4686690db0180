#!/usr/bin/env bash
# The GPU checks, for the device machine (no cargo there: carry a built target/release/tpar,
# and for `python` the wheel in .ci/wheels). Each step's log and JSON go to /tmp/gpu-out/<mode>;
# after each mode its folder is packed into $OUT/gpu-<mode>.tar.gz (only 8 files come back), and a
# summary is printed at the end. Several modes may be given: scripts/gpu-check.sh python step
#   smoke | full | tools | auto : the one-GPU checks of the CUDA backend, doctor/tune, dispatch
#   multi  : one process per GPU against NCCL on a multi-GPU machine (issue 7); WORLD_SIZES="8"
#            and MULTI_ALGOS=one-shot,two-shot,nccl,auto narrow it to fit one call
#   oneshot: one-shot across GPUs with and without pauses between polls (the 200-400 us state)
#   tune   : tpar tune and doctor with one process per GPU
#   python : the Python package's CUDA tests and examples/tp_mlp.py, ranks sharing GPU 0 and
#            (with several GPUs) one per GPU
#   step   : tpar bench step on the model fixtures (norms separate and fused into the allreduce)
#   harness: issue 17's harness in the library, under 5 minutes on one GPU: selftest -n 2 and
#            -n 8 (the sweep, its fused rows, the one check), doctor (its quick check), bench,
#            --anatomy, --fused, bench step, tune, then tpar.verify/tpar.tune from Python (needs
#            the wheel in .ci/wheels); compare the logs with the same mode on the parent commit
#   config : the config branch (one Config, one Span type, selftest rows, cuda_rank.py), < 5 min
#   cli    : issue 17's CLI moves (launcher, reports, printers in the library and tpar-report),
#            each CUDA path of the binary once, under 4 minutes on one GPU: selftest threads and
#            --processes, bench threads (JSON, plot) and --processes, --anatomy, --fused, bench
#            step, tune, doctor; JSON and SVG in $OUT/gpu-cli.tar.gz
#   fused-py : the fused allreduce + residual + RMSNorm from Python (issue 15): CUDA tests at 2
#            ranks sharing GPU 0 and a timing of the op eager/graph (scripts/gpu_fused_py.py)
#   engine-comm : issue 12 on GPU 0 (needs torch and the wheel in .ci/wheels): footprint reported
#            vs measured drop in free device memory (1 and 2 ranks, nccl own/none), 1,000
#            create/use/close cycles, calls from 2 and 3 streams eager and in one graph, several
#            communicators and subgroups, init cost of 8 groups; table last, JSON in $OUT
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TPAR_CACHE_DIR=/tmp/tpar-cache PYTHONUNBUFFERED=1
tpar=./target/release/tpar
modes=("${@:-full}")
root=/tmp/gpu-out
summary=()
step() { # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-34s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E '^selftest:|passed|failed' "$out/$name.log" | tail -1 | cut -c1-90)")")
}
gpus=$(nvidia-smi -L | wc -l)
models=crates/tpar-harness/fixtures/models
for mode in "${modes[@]}"; do
out=$root/$mode; mkdir -p "$out"
sizes=0,4K,8K,16K,32K,42K,64K,128K,256K,1M,4M,8M
if [ "$mode" = tools ]; then
  logs=$out; out_final=$out
  step selftest-1 120 $tpar selftest --backend cuda -n 1 --counts 0,7,4099,70001 --replays 20
  step doctor 120 $tpar doctor
  cp $logs/doctor.log $out_final/doctor.txt
  $tpar doctor --json > $out_final/doctor.json 2>/dev/null
  step tune-8 300 $tpar tune --world-size 8 --json "$out_final/tune-8.json"
  step doctor-8-tuned 120 $tpar doctor -n 8
  cat $logs/tune-8.log $logs/doctor-8-tuned.log > $out_final/tune-8-and-doctor.txt
  step bench-nccl-1 200 $tpar bench --backend cuda -n 1 --sizes 4K,32K,256K,1M,4M,16M,64M --json "$out_final/bench-cuda-1-nccl.json" --plot "$out_final/bench-cuda-1.svg"
  step bench-plot-2 200 $tpar bench --backend cuda -n 2 --sizes 4K,16K,42K,128K,512K,2M,8M --json "$out_final/bench-cuda-2-plot.json" --plot "$out_final/bench-cuda-2.svg"
elif [ "$mode" = auto ]; then
  # The one call behind which the dispatcher picks tpar or NCCL (and TPAR_ALGO forces).
  step selftest-processes-4 200 $tpar selftest --backend cuda -n 4 --processes --counts 0,7,4099,65541 --replays 20
  step bench-auto-1 120 $tpar bench --backend cuda -n 1 --sizes 4K,256K,16M --json "$out/bench-auto-1.json"
  step bench-auto-8 120 $tpar bench --backend cuda -n 8 --sizes 4K,42K,256K,4M --algos auto,one-shot,two-shot --json "$out/bench-auto-8.json"
  TPAR_ALGO=host-staged step bench-forced-host-2 120 $tpar bench --backend cuda -n 2 --sizes 4K,42K --algos auto
  TPAR_ALGO=nccl step bench-forced-nccl-2 120 $tpar bench --backend cuda -n 2 --sizes 4K --algos auto
elif [ "$mode" = multi ]; then
  # One process per GPU: tpar's algorithms beside NCCL in the same run, then host-staged
  # against NCCL without P2P (its shared-memory path through host memory: the same wires).
  nvidia-smi topo -m > $out/topo.txt 2>&1
  step doctor 60 $tpar doctor
  $tpar doctor --json > $out/doctor.json 2>/dev/null
  RUST_LOG=${RUST_LOG:-info} step selftest-$gpus-processes 150 $tpar selftest --backend cuda -n $gpus --processes --counts 0,7,4099,65541 --replays 20
  # WORLD_SIZES picks the sweeps (all three take longer than one 10-minute call on 8 GPUs).
  for ws in ${WORLD_SIZES:-2 4 8}; do
    [ $ws -le $gpus ] || continue
    step bench-$ws-processes 200 $tpar bench --backend cuda -n $ws --processes --algos ${MULTI_ALGOS:-one-shot,two-shot,one-shot-pull,host-staged,nccl,auto} \
      --sizes 1K,4K,16K,32K,42K,64K,256K,1M,4M,16M,64M --iters 30 --json "$out/bench-$ws-processes.json" --plot "$out/bench-$ws-processes.svg"
    NCCL_P2P_DISABLE=1 step bench-$ws-processes-no-p2p 100 $tpar bench --backend cuda -n $ws --processes --algos host-staged,nccl \
      --sizes 4K,16K,42K,64K,256K --iters 30 --json "$out/bench-$ws-processes-no-p2p.json" --plot "$out/bench-$ws-processes-no-p2p.svg"
  done
elif [ "$mode" = tune ]; then
  step tune-$gpus 150 $tpar tune -n $gpus --processes --iters 20 --sizes 4K,16K,64K,256K,1M,4M,16M --json "$out/tune-$gpus.json"
  step doctor-tuned 60 $tpar doctor -n $gpus
elif [ "$mode" = oneshot ]; then
  # One-shot across GPUs: does polling device memory slow the peers' incoming writes? The same
  # rows with pauses between polls, in processes and with every rank in one process.
  ( sleep 15; nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv ) > $out/compute-apps.txt 2>&1 &
  n=$(( gpus < 4 ? gpus : 4 ))
  for ns in 0 256 2048; do
    TPAR_KERNEL_DEFINES="-DTPAR_DEVICE_POLL_SLEEP_MAX_NS=$ns" step oneshot-$n-processes-pause$ns 90 $tpar bench --backend cuda -n $n --processes \
      --algos one-shot,two-shot,nccl --sizes 16K,32K,42K,64K,256K --iters 30 --json "$out/oneshot-$n-processes-pause$ns.json"
  done
  step oneshot-$n-threads 60 $tpar bench --backend cuda -n $n --algos one-shot,two-shot --sizes 16K,32K,42K,64K,256K --iters 30 --json "$out/oneshot-$n-threads.json"
elif [ "$mode" = python ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ci/wheels/tpar-*.whl > $out/pip.log 2>&1
  export PYTHONPATH=/tmp/site
  python3 -c "import torch, tpar; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'tpar', tpar.__version__)" > $out/versions.log 2>&1
  # Rank logs land in the mode's folder as they are written; leftovers of a stopped step go.
  export TPAR_TEST_LOGS=$out/ranks-shared
  # 8 ranks time-sliced on one GPU is the slowest test: on its own, after the rest has run.
  CUDA_VISIBLE_DEVICES=0 step pytest-cuda-shared-gpu 200 python3 -m pytest -rs -v -s --durations=0 tests/python/test_cuda_allreduce.py -k "not 8"
  pkill -9 -f cuda_worker.py; pkill -9 -f tp_mlp.py
  CUDA_VISIBLE_DEVICES=0 step pytest-cuda-shared-gpu-8 200 python3 -m pytest -rs -v -s --durations=0 tests/python/test_cuda_allreduce.py -k 8
  pkill -9 -f cuda_worker.py; pkill -9 -f tp_mlp.py
  if [ $gpus -gt 1 ] && [ "${PER_GPU:-1}" = 1 ]; then
    export TPAR_TEST_LOGS=$out/ranks-per-gpu
    select="graph or mlp"; [ $gpus -ge 8 ] || select="not 8 and ($select)"
    step pytest-cuda-gpu-per-rank 150 python3 -m pytest -rs -v -s --durations=0 tests/python/test_cuda_allreduce.py -k "$select"
    pkill -9 -f cuda_worker.py; pkill -9 -f tp_mlp.py
  fi
  step pytest-cpu-package 150 python3 -m pytest -rs -q tests/python/test_cpu_allreduce.py
elif [ "$mode" = engine-comm ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ci/wheels/tpar-*.whl > $out/pip.log 2>&1
  export PYTHONPATH=/tmp/site
  # The CPU half with torch present (torch group= subgroups), then the GPU half.
  step pytest-engine-comm-cpu 120 python3 -m pytest -rs -q tests/python/test_cpu_engine_comm.py
  OUT=$out CUDA_VISIBLE_DEVICES=0 step engine-comm 360 python3 scripts/gpu_engine_comm.py
  cp $out/engine-comm.json "${OUT:-.}/engine-comm.json" 2>/dev/null
  grep -A40 '== engine-comm summary' $out/engine-comm.log
elif [ "$mode" = step ]; then
  if [ $gpus -gt 1 ]; then
    for m in llama-3.1-70b deepseek-v3; do for k in 1 4; do
      step step-$m-tp$gpus-tokens$k 100 $tpar bench step --config $models/$m.json --tp $gpus --tokens $k --processes --json "$out/step-$m-tp$gpus-tokens$k.json"
    done; done
  fi
  step step-llama-tp8-shared-gpu 220 env CUDA_VISIBLE_DEVICES=0 $tpar bench step --config $models/llama-3.1-70b.json --tp 8 --tokens 4 --algos auto,one-shot --json "$out/step-llama-tp8-shared-gpu.json"
  step step-llama-tp1-nccl 100 env CUDA_VISIBLE_DEVICES=0 $tpar bench step --config $models/llama-3.1-70b.json --tp 1 --tokens 4 --algos nccl,auto --json "$out/step-llama-tp1.json"
elif [ "$mode" = engines ]; then
  # tpar.engines under vLLM's / SGLang's calling sequence (scripts/engine_harness.py): TP 2
  # and 4 ranks sharing GPU 0, then one GPU per rank where there are several (the engine's
  # NCCL fallback needs that); ENGINES_SHARED=0 runs only the latter. Needs the wheel in
  # .ci/wheels; SGLang's own GroupCoordinator also runs when .ci/engines-gpu is carried
  # (scripts/engine_harness_bundle.sh builds it: SGLang's sources and its imports for cp312).
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .ci/wheels/tpar-*.whl > $out/pip.log 2>&1
  export PYTHONPATH=/tmp/site
  sglang=0
  if [ -d .ci/engines-gpu ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/sglang-site .ci/engines-gpu/deps/*.whl > $out/pip-sglang.log 2>&1
    rm -rf /tmp/sglang-src && python3 -m zipfile -e .ci/engines-gpu/sglang-0.5.23-src.zip /tmp/sglang-src && sglang=1
  fi
  with_sglang="/tmp/site:/tmp/sglang-site:/tmp/sglang-src"
  tps="2"; [ $gpus -ge 4 ] && tps="2 4"
  if [ "${ENGINES_SHARED:-1}" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 step engines-shared-gpu 230 python3 scripts/engine_harness.py --tp 2 4 --timeout 110 --out $out/shared-gpu
    [ $sglang = 1 ] && PYTHONPATH=$with_sglang CUDA_VISIBLE_DEVICES=0 step sglang-shared-gpu 170 python3 scripts/engine_harness.py --sglang --tp 2 4 --timeout 80 --out $out/sglang-shared-gpu
  fi
  if [ $gpus -gt 1 ]; then
    step engines-gpu-per-rank 170 python3 scripts/engine_harness.py --tp $tps --timeout 80 --out $out/gpu-per-rank
    [ $sglang = 1 ] && PYTHONPATH=$with_sglang step sglang-gpu-per-rank 170 python3 scripts/engine_harness.py --sglang --tp $tps --timeout 80 --out $out/sglang-gpu-per-rank
  fi
elif [ "$mode" = fused-py ]; then
  # Issue 15 from Python (needs the wheel in .ci/wheels): the fused op's CUDA tests (eager over
  # dtypes/shapes/paths, a replayed graph, torch.compile, errors; bitwise against tpar's CPU path
  # and across ranks) with 2 ranks sharing GPU 0 (FUSED_PY_RANKS=4 adds 4), then its timing
  # (eager and a graph chain, 2 ranks as threads on GPU 0); table last, JSON in $OUT.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ci/wheels/tpar-*.whl > $out/pip.log 2>&1
  export PYTHONPATH=/tmp/site TPAR_TEST_LOGS=$out/ranks
  select="not [4]"; [ "${FUSED_PY_RANKS:-2}" = 4 ] && select=""
  CUDA_VISIBLE_DEVICES=0 step pytest-cuda-fused 170 python3 -m pytest -rs -v -s tests/python/test_cuda_fused.py -k "$select"
  OUT=$out CUDA_VISIBLE_DEVICES=0 step fused-py-timing 60 python3 scripts/gpu_fused_py.py --world-size 2
  cp $out/fused-py.json "${OUT:-.}/fused-py.json" 2>/dev/null
elif [ "$mode" = harness ]; then
  step selftest-threads-2 75 $tpar selftest --backend cuda -n 2 --counts 0,7,4099,65541 --replays 50
  step selftest-threads-8 75 $tpar selftest --backend cuda -n 8 --counts 0,7,4099 --dtypes bf16 --replays 20
  step doctor 30 $tpar doctor
  step bench-threads-2 30 $tpar bench --backend cuda -n 2 --sizes 4K,42K,1M --iters 20 --chain 20 --json "$out/bench-2.json"
  step anatomy-2 25 $tpar bench --anatomy -n 2 --iters 10 --json "$out/anatomy-2.json"
  step fused-2 25 $tpar bench --fused -n 2 --iters 20 --chain 20 --json "$out/fused-2.json"
  step step-llama-tp2 40 $tpar bench step --config $models/llama-3.1-70b.json -n 2 --layers 4 --replays 5 --json "$out/step-2.json"
  step tune-1 40 env TPAR_CACHE_DIR=/tmp/tpar-harness-tune $tpar tune -n 1 --sizes 4K,64K,1M --iters 10 --json "$out/tune-1.json"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ci/wheels/tpar-*.whl > $out/pip.log 2>&1
  PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0 TPAR_CACHE_DIR=/tmp/tpar-harness-tune step pytest-harness 60 python3 -m pytest -rs -v tests/python/test_harness.py
elif [ "$mode" = config ]; then
  # The config branch on one GPU, under 5 minutes (needs the wheel in .ci/wheels): one
  # tpar::Config through threads and processes (CUDA chunk default 256 KiB: 1048579 elements
  # are several chunks), span.rs's one Span type and cuda_selftest's record_case (the eager
  # and graph rows), check_available and the link measurement's names (doctor), and the CUDA
  # workers' shared setup (tests/python/cuda_rank.py) with the binding's one Config.
  step selftest-threads-2 60 $tpar selftest --backend cuda -n 2 --counts 0,7,4099,1048579 --replays 50
  step selftest-processes-2 50 $tpar selftest --backend cuda -n 2 --processes --counts 0,7,4099 --replays 20
  step doctor 20 $tpar doctor
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ci/wheels/tpar-*.whl > $out/pip.log 2>&1
  export PYTHONPATH=/tmp/site TPAR_TEST_LOGS=$out/ranks
  CUDA_VISIBLE_DEVICES=0 step pytest-cuda-worker 110 python3 -m pytest -rs -v -s tests/python/test_cuda_allreduce.py -k "exact_sums and 2 or errors_name"
  CUDA_VISIBLE_DEVICES=0 step pytest-cuda-fused-errors 50 python3 -m pytest -rs -v -s tests/python/test_cuda_fused.py -k errors
elif [ "$mode" = cli ]; then
  step selftest-threads-2 45 $tpar selftest --backend cuda -n 2 --counts 0,7,4099 --replays 20
  step selftest-processes-2 45 $tpar selftest --backend cuda -n 2 --processes --counts 0,7,4099 --replays 20
  step bench-threads-2 30 $tpar bench --backend cuda -n 2 --sizes 4K,42K --iters 20 --chain 20 --json "$out/bench-2.json" --plot "$out/bench-2.svg"
  step bench-processes-2 40 $tpar bench --backend cuda -n 2 --processes --sizes 4K --algos one-shot,nccl,auto --iters 20 --chain 20 --json "$out/bench-processes-2.json"
  step anatomy-2 25 $tpar bench --anatomy -n 2 --iters 10 --json "$out/anatomy-2.json"
  step fused-2 25 $tpar bench --fused -n 2 --iters 20 --chain 20 --json "$out/fused-2.json"
  step step-llama-tp2 40 $tpar bench step --config $models/llama-3.1-70b.json -n 2 --layers 2 --replays 3 --json "$out/step-2.json"
  step tune-1 40 env TPAR_CACHE_DIR=/tmp/tpar-cli-tune $tpar tune -n 1 --sizes 4K,64K --iters 10 --json "$out/tune-1.json"
  step doctor 30 $tpar doctor --json
elif [ "$mode" = smoke ]; then
  step selftest-threads-2 120 $tpar selftest --backend cuda -n 2 --counts 0,1,7,1023,70001 --replays 20
  step bench-threads-2 120 $tpar bench --backend cuda -n 2 --sizes 4K,42K,1M --iters 20 --chain 20
else
  step selftest-threads-8 300 $tpar selftest --backend cuda -n 8 --counts 0,1,7,1023,65541,1048579,2097152
  step selftest-processes-4 300 $tpar selftest --backend cuda -n 4 --processes --counts 0,1,7,1023,65541 --replays 50
  step bench-threads-2 200 $tpar bench --backend cuda -n 2 --sizes $sizes --json "$out/bench-cuda-2.json"
  step bench-threads-8 200 $tpar bench --backend cuda -n 8 --sizes $sizes --json "$out/bench-cuda-8.json"
fi
for f in "$out"/*.log; do
  [ -f "$f" ] && { echo "== $f"; grep -vE '^\[' "$f" | tail -n 25; }
done
# Packed per mode, so that a call cut off at its time limit still returns the modes before.
tar czf "${OUT:-.}/gpu-$mode.tar.gz" -C $root "$mode" 2>/dev/null
done
printf '%s\n' "${summary[@]}"
