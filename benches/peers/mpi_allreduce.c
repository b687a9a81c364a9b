/* MPI_Allreduce timing with the same method and columns as `xtrain bench comm`, so Open MPI
 * can be measured beside xtrain on the same machine: f32 sum, sizes doubling from 4 KiB to
 * 256 MiB, warm-up iterations, then timed iterations each starting from MPI_Barrier; an
 * iteration's time is the slowest rank's (MPI_MAX), and the median over iterations is printed.
 * busbw = algbw * 2(n-1)/n (nccl-tests' all-reduce factor).
 *
 * Build and run (see README.md beside this file):
 *   mpicc -O2 -o mpi_allreduce benches/peers/mpi_allreduce.c
 *   mpirun -np 2 ./mpi_allreduce [min_bytes max_bytes iters]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t min = argc > 1 ? strtoull(argv[1], NULL, 10) : 4096;
    size_t max = argc > 2 ? strtoull(argv[2], NULL, 10) : (size_t)256 << 20;
    int base_iters = argc > 3 ? atoi(argv[3]) : 20;
    if (rank == 0) {
        printf("# MPI_Allreduce over %d rank(s); f32 sum; time = median over iterations of the "
               "slowest rank\n", n);
        printf("#%11s %12s %6s %12s %12s %12s %7s\n", "size(B)", "count", "iters", "time(us)",
               "algbw(GB/s)", "busbw(GB/s)", "#wrong");
    }
    for (size_t bytes = min; bytes <= max; bytes *= 2) {
        size_t count = bytes / 4;
        /* Same schedule as xtrain: full iterations up to 16 MiB, scaled down above (>= 3). */
        size_t full = (size_t)16 << 20;
        int iters = bytes <= full ? base_iters : (int)((size_t)base_iters * full / bytes);
        if (iters < 3) iters = 3;
        if (iters > base_iters) iters = base_iters;
        int warmup = iters < 5 ? iters : 5;
        float *buf = malloc(count * sizeof(float));
        /* Correctness: rank r contributes (r+1)*(i%13+1); the sum is exact in f32. */
        for (size_t i = 0; i < count; i++) buf[i] = (float)((rank + 1) * (i % 13 + 1));
        MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        long wrong = 0;
        for (size_t i = 0; i < count; i++)
            if (buf[i] != (float)((n * (n + 1) / 2) * (i % 13 + 1))) wrong++;
        long wrong_total = 0;
        MPI_Allreduce(&wrong, &wrong_total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
        for (int w = 0; w < warmup; w++)
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double *t = malloc(iters * sizeof(double));
        for (int it = 0; it < iters; it++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            t[it] = MPI_Wtime() - t0;
        }
        MPI_Allreduce(MPI_IN_PLACE, t, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        qsort(t, iters, sizeof(double), cmp);
        double med = iters % 2 ? t[iters / 2] : (t[iters / 2 - 1] + t[iters / 2]) / 2;
        double algbw = (double)bytes / med / 1e9;
        if (rank == 0)
            printf("%12zu %12zu %6d %12.1f %12.3f %12.3f %7ld\n", bytes, count, iters, med * 1e6,
                   algbw, algbw * 2.0 * (n - 1) / n, wrong_total);
        free(t);
        free(buf);
    }
    MPI_Finalize();
    return 0;
}
