# Session 16, call 3: the GPU suite's engines group on main (.ci/gpu, built at a799f33 = cd689f2's
# code), then every algorithm's selftest at 7 ranks as streams (last run on ee3e89a).
export NCCL_NVLS_ENABLE=0
bash scripts/gpu-check.sh $OUT engines
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
start=$(date +%s)
timeout 100 .ci/gpu/tpar selftest --backend cuda -n 7 > $OUT/selftest-7.txt 2>&1
echo "selftest -n 7: rc=$? $(( $(date +%s) - start )) s, $(grep -E 'passed|failed' $OUT/selftest-7.txt | tail -n 1)" | tee -a $OUT/selftest-7.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $OUT/selftest-7.txt
