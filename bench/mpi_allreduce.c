/* Open MPI's MPI_Allreduce timed the way `tpar bench --backend cpu` times tpar: the same sizes,
 * warm-up calls, then a wall-clock time around each timed call on rank 0, p50/p99 over them,
 * and every timed call's result checked against the exact sum (counted across ranks).
 * bench/cpu_vs_mpi.py compiles it with mpicc and runs it under mpirun.
 *
 * Usage: mpi_allreduce DTYPE ITERS WARMUP BYTES...   (DTYPE: f32 or bf16)
 * Prints one JSON object per size on rank 0:
 *   {"bytes": B, "p50_us": x, "p99_us": y, "correct": true}
 *
 * bf16: MPI has no bf16 type, so the data travel as MPI_UINT16_T and a user-defined,
 * commutative MPI_Op sums them in f32 and rounds to nearest even (what an engine does when it
 * brings its own op); f32 uses MPI_FLOAT with MPI_SUM (Open MPI's own, vectorised, op). */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static uint16_t f32_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static void bf16_sum(void *in, void *inout, int *len, MPI_Datatype *type) {
  (void)type;
  const uint16_t *a = (const uint16_t *)in;
  uint16_t *b = (uint16_t *)inout;
  for (int i = 0; i < *len; i++) b[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The value at `p` percent of sorted `v`, nearest rank (as tpar's stats::percentile). */
static double percentile(const double *v, int n, double p) {
  int rank = (int)ceil(p / 100.0 * n);
  if (rank < 1) rank = 1;
  if (rank > n) rank = n;
  return v[rank - 1];
}

/* Small integers, exact in bf16 and in any summation order, different per rank and seed. */
static float value(long i, int rank, int seed) {
  return (float)(((i * 7 + rank * 13 + seed * 5) % 17) - 8);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (argc < 5) {
    if (rank == 0) fprintf(stderr, "usage: %s f32|bf16 ITERS WARMUP BYTES...\n", argv[0]);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  int bf16 = strcmp(argv[1], "bf16") == 0;
  int iters = atoi(argv[2]), warmup = atoi(argv[3]);
  size_t esize = bf16 ? 2 : 4;
  MPI_Op op = MPI_SUM;
  MPI_Datatype type = MPI_FLOAT;
  if (bf16) {
    MPI_Op_create(bf16_sum, 1, &op);
    type = MPI_UINT16_T;
  }
  double *samples = malloc(sizeof(double) * iters);
  for (int a = 4; a < argc; a++) {
    long bytes = atol(argv[a]);
    long count = bytes / (long)esize;
    void *in[2], *expected[2];
    void *out = malloc(bytes);
    for (int s = 0; s < 2; s++) {
      in[s] = malloc(bytes);
      expected[s] = malloc(bytes);
      for (long i = 0; i < count; i++) {
        float total = 0;
        for (int r = 0; r < world; r++) total += value(i, r, s + 1);
        if (bf16) {
          ((uint16_t *)in[s])[i] = f32_to_bf16(value(i, rank, s + 1));
          ((uint16_t *)expected[s])[i] = f32_to_bf16(total);
        } else {
          ((float *)in[s])[i] = value(i, rank, s + 1);
          ((float *)expected[s])[i] = total;
        }
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < warmup; i++) MPI_Allreduce(in[i % 2], out, (int)count, type, op, MPI_COMM_WORLD);
    long wrong = 0;
    for (int i = 0; i < iters; i++) {
      double start = now_us();
      MPI_Allreduce(in[i % 2], out, (int)count, type, op, MPI_COMM_WORLD);
      samples[i] = now_us() - start;
      wrong += memcmp(out, expected[i % 2], bytes) != 0;
    }
    long wrong_total = 0;
    MPI_Allreduce(&wrong, &wrong_total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) {
      qsort(samples, iters, sizeof(double), cmp_double);
      printf("{\"bytes\": %ld, \"p50_us\": %.3f, \"p99_us\": %.3f, \"correct\": %s}\n", bytes,
             percentile(samples, iters, 50), percentile(samples, iters, 99),
             wrong_total == 0 ? "true" : "false");
      fflush(stdout);
    }
    for (int s = 0; s < 2; s++) {
      free(in[s]);
      free(expected[s]);
    }
    free(out);
  }
  free(samples);
  if (bf16) MPI_Op_free(&op);
  MPI_Finalize();
  return 0;
}
