set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/p/tpar-*.whl > /dev/null 2>&1
PYTHONPATH=/tmp/site timeout 200 python3 .stage/p/prof.py 2>&1 | grep -v Warning | tail -60
