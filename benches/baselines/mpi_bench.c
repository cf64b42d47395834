/* Open MPI baseline for `lockstep bench`: same sizes, same columns, median over iterations of the
 * per-call time (max over ranks), plus a ninth column: the 99th percentile (max over ranks), which
 * `lockstep bench --format csv` reports as oop_p99_us. Build: mpicc -O2 -o mpi_bench mpi_bench.c
 * Run:   mpirun -np 2 ./mpi_bench all_reduce 8,1048576,67108864 [median|mean] [ITERS]
 * A third argument `mean` reports the mean over iterations instead of the median (max over ranks
 * either way: `lockstep bench --stat mean -a 3` reports the same statistic); a fourth, the timed
 * iterations per size (default: 4 GiB / size, between 9 and 2000).
 * Ops: all_reduce, broadcast, all_gather, reduce_scatter, all_to_all, pingpong (ranks 0 and 1,
 * one-way time = half the round trip, as osu_latency). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    const char *op = argc > 1 ? argv[1] : "all_reduce";
    char *sizes = strdup(argc > 2 ? argv[2] : "8,1048576,67108864");
    int mean = argc > 3 && !strcmp(argv[3], "mean");
    size_t fixed_iters = argc > 4 ? strtoull(argv[4], NULL, 10) : 0;
    if (rank == 0) printf("%12s %12s %6s %6s %10s %8s %8s %7s %10s\n", "size(B)", "count", "type", "redop", "time(us)", "algbw", "busbw", "#wrong", "p99(us)");
    for (char *tok = strtok(sizes, ","); tok; tok = strtok(NULL, ",")) {
        size_t bytes = strtoull(tok, NULL, 10);
        size_t count = bytes / 4;
        int gather = !strcmp(op, "all_gather"), rs = !strcmp(op, "reduce_scatter"), bc = !strcmp(op, "broadcast");
        int a2a = !strcmp(op, "all_to_all"), pp = !strcmp(op, "pingpong");
        size_t scount = gather ? count / n : count, rcount = rs ? count / n : count;
        float *s = malloc(scount * 4 + 64), *r = malloc(rcount * 4 + 64);
        for (size_t i = 0; i < scount; i++) s[i] = (float)((rank + i) % 3);
        memset(r, 0, rcount * 4);
        int *rc = malloc(sizeof(int) * n);
        for (int i = 0; i < n; i++) rc[i] = (int)rcount;
        size_t iters = (4ull << 30) / (bytes ? bytes : 1);
        if (iters < 9) iters = 9;
        if (iters > 2000) iters = 2000;
        if (fixed_iters > 0) iters = fixed_iters;
        double *t = malloc(sizeof(double) * iters);
        for (size_t it = 0; it < iters + 5; it++) {
            if (it == 5) MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            if (a2a) MPI_Alltoall(s, (int)(count / n), MPI_FLOAT, r, (int)(count / n), MPI_FLOAT, MPI_COMM_WORLD);
            else if (pp && rank == 0) {
                MPI_Send(s, (int)count, MPI_FLOAT, 1, 0, MPI_COMM_WORLD);
                MPI_Recv(r, (int)count, MPI_FLOAT, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            } else if (pp && rank == 1) {
                MPI_Recv(r, (int)count, MPI_FLOAT, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                MPI_Send(s, (int)count, MPI_FLOAT, 0, 0, MPI_COMM_WORLD);
            } else if (pp) {
            } else if (gather) MPI_Allgather(s, (int)scount, MPI_FLOAT, r, (int)scount, MPI_FLOAT, MPI_COMM_WORLD);
            else if (rs) MPI_Reduce_scatter(s, r, rc, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            else if (bc) MPI_Bcast(s, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
            else MPI_Allreduce(s, r, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            if (it >= 5) t[it - 5] = MPI_Wtime() - t0;
        }
        qsort(t, iters, sizeof(double), cmp);
        /* Ping-pong reports the one-way time: half the round trip (as osu_latency). */
        size_t i99 = iters * 99 / 100 < iters ? iters * 99 / 100 : iters - 1;
        double sum = 0;
        for (size_t i = 0; i < iters; i++) sum += t[i];
        double typical = mean ? sum / (double)iters : t[iters / 2];
        double q[2] = {typical * 1e6 * (pp ? 0.5 : 1.0), t[i99] * 1e6 * (pp ? 0.5 : 1.0)}, qm[2];
        MPI_Allreduce(q, qm, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        double mx = qm[0], p99 = qm[1];
        double algbw = bytes / (mx * 1e-6) / 1e9;
        double f = !strcmp(op, "all_reduce") ? 2.0 * (n - 1) / n : (gather || rs || a2a) ? (double)(n - 1) / n : 1.0;
        if (rank == 0) printf("%12zu %12zu %6s %6s %10.2f %8.2f %8.2f %7d %10.2f\n", bytes, count, "f32", bc || gather || a2a || pp ? "none" : "sum", mx, algbw, algbw * f, 0, p99);
        free(s); free(r); free(t); free(rc);
    }
    MPI_Finalize();
    return 0;
}
