# Session 18, call 1: the ring's batched loads (TPAR_RING_BATCH, new default 2) and two-shot's
# batched all-gather (TPAR_GATHER_BATCH, an experiment define) against main (67dcd99); ring
# selftests on the new binary; the 2-rank row-order check of auto.
source scripts/gpu-compare.sh
B=.gpu/tpar-base; N=.gpu/tpar-new
S8="--backend cuda -n 8 --sizes 64K,256K,1M,2M,4M"
go() { if [ $SECONDS -lt 470 ]; then run "$@"; else echo "$1 skipped: time" >> "$SUMMARY"; fi; }
go r8-base-1 90 $B bench $S8 --algos two-shot,ring --json $R/r8-base-1.json
go r8-new-1 90 $N bench $S8 --algos two-shot,ring --json $R/r8-new-1.json
go r8-b4-1 90 env TPAR_KERNEL_DEFINES=-DTPAR_RING_BATCH=4 $N bench $S8 --algos ring --json $R/r8-b4-1.json
go r8-g2-1 90 env TPAR_KERNEL_DEFINES=-DTPAR_GATHER_BATCH=2 $N bench $S8 --algos two-shot --json $R/r8-g2-1.json
go r8-g4-1 90 env TPAR_KERNEL_DEFINES=-DTPAR_GATHER_BATCH=4 $N bench $S8 --algos two-shot --json $R/r8-g4-1.json
go st8 120 $N selftest --backend cuda -n 8 --algos ring
go r8-base-2 90 $B bench $S8 --algos two-shot,ring --json $R/r8-base-2.json
go r8-new-2 90 $N bench $S8 --algos two-shot,ring --json $R/r8-new-2.json
go r8-b1-2 90 env TPAR_KERNEL_DEFINES=-DTPAR_RING_BATCH=1 $N bench $S8 --algos ring --json $R/r8-b1-2.json
go r2-base 60 $B bench --backend cuda -n 2 --algos two-shot,ring --sizes 256K,1M,4M --json $R/r2-base.json
go r2-new 60 $N bench --backend cuda -n 2 --algos two-shot,ring --sizes 256K,1M,4M --json $R/r2-new.json
go st3 90 $N selftest --backend cuda -n 3 --algos ring
go stp4 100 $N selftest --backend cuda -n 4 --processes --algos ring --replays 20
go af-new-1 40 $N bench --backend cuda -n 2 --sizes 64K,256K,1M --algos auto,one-shot --json $R/af-new-1.json
go al-new-1 40 $N bench --backend cuda -n 2 --sizes 64K,256K,1M --algos one-shot,auto --json $R/al-new-1.json
finish
