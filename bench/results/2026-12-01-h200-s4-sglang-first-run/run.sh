set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .ci/wheels/tpar-*.whl > /dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/sglang-site .ci/engines-gpu/deps/*.whl > /dev/null 2>&1
python3 -m zipfile -e .ci/engines-gpu/sglang-0.5.23-src.zip /tmp/sglang-src
echo "== host cost (tpar.ops on Library registration)"
PYTHONPATH=/tmp/site timeout 150 python3 .stage/sg1/prof.py 2>&1 | grep -v Warning | head -14 | tee $OUT/host-cost.txt
echo "== SGLang fusion"
PYTHONPATH=/tmp/site:/tmp/sglang-site:/tmp/sglang-src CUDA_VISIBLE_DEVICES=0 timeout 300 python3 scripts/gpu_sglang_fusion.py --sglang /tmp/sglang-src 2>&1 | tail -40
