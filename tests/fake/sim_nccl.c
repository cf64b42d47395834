/* A simulated NCCL for tests without a GPU, paired with sim_cuda.c (device memory is host
 * memory). World size 1 only: every collective copies send to recv; send/recv pairs inside a
 * group are matched at ncclGroupEnd. A communicator with more than one rank never finishes
 * initialising (a peer that never joins), unless SIM_NCCL_RDZV_DIR names a directory: then the
 * ranks of one unique id meet there through one file each (processes of a multi-node test), and
 * collectives still only copy, but complete only once every rank has made the same numbered call
 * (one more file each): on a non-blocking communicator the call returns ncclInProgress until then,
 * so a rank whose peer died waits as it would on NCCL. Fault injection: SIM_NCCL_ASYNC_ERROR=1 makes
 * ncclCommGetAsyncError report ncclRemoteError after the first collective. ncclCommSplit: see
 * below. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct { size_t size; unsigned magic, version; int blocking; } cfg_head;
typedef struct { int nranks, rank, state, ops, blocking, waiting; char key[64]; } comm_t;
static int abort_calls = 0, destroy_calls = 0, in_group = 0, nsend = 0, nrecv = 0;
static const void* sends[64]; static size_t send_bytes[64];
static void* recvs[64]; static size_t recv_bytes[64];
static size_t dsize(int dt) { static const size_t s[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2}; return dt >= 0 && dt < 10 ? s[dt] : 0; }

int ncclGetVersion(int* v) { const char* s = getenv("SIM_NCCL_VERSION"); *v = s ? atoi(s) : 21803; return 0; }
static int uid_count = 0;
/* A different id per call and process, so a test sees whether the right one arrived. */
int ncclGetUniqueId(ncclUniqueId* id) { memset(id, 0, sizeof *id); snprintf(id->internal, 64, "sim-%d-%d", (int)getpid(), ++uid_count); return 0; }
const char* ncclGetErrorString(int r) { return r == 0 ? "no error" : r == 6 ? "remote process exited or there was a network error" : "simulated NCCL error"; }
const char* ncclGetLastError(void* c) { return ""; }
int sim_abort_calls(void) { return abort_calls; }
int sim_destroy_calls(void) { return destroy_calls; }

/* A rank's file for initialisation (op 0) or its numbered call. */
static void rdzv_op_file(const comm_t* c, int r, int op, char* out, size_t n) {
    if (op == 0) snprintf(out, n, "%s/%s.%d", getenv("SIM_NCCL_RDZV_DIR"), c->key, r);
    else snprintf(out, n, "%s/%s.%d.op%d", getenv("SIM_NCCL_RDZV_DIR"), c->key, r, op);
}
static void rdzv_file(const comm_t* c, int r, char* out, size_t n) { rdzv_op_file(c, r, 0, out, n); }
static comm_t* make(int nranks, int rank, const ncclUniqueId* id) {
    comm_t* c = calloc(1, sizeof *c); c->nranks = nranks; c->rank = rank; c->state = nranks == 1 ? 0 : 7;
    for (int i = 0; i < 63 && id->internal[i]; i++) { char ch = id->internal[i]; c->key[i] = (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || ch == '-' ? ch : '_'; }
    if (!c->key[0]) strcpy(c->key, "empty-id");
    if (nranks > 1 && getenv("SIM_NCCL_RDZV_DIR")) { char p[512]; rdzv_file(c, rank, p, sizeof p); FILE* f = fopen(p, "w"); if (f) fclose(f); }
    return c;
}
/* Initialisation (or the call being waited for) finishes once every rank of the id has arrived. */
static void progress(comm_t* c) {
    if (c->state != 7 || !getenv("SIM_NCCL_RDZV_DIR")) return;
    for (int r = 0; r < c->nranks; r++) { char p[512]; rdzv_op_file(c, r, c->waiting, p, sizeof p); if (access(p, F_OK) != 0) return; }
    c->state = 0;
}
int ncclCommInitRank(comm_t** c, int nranks, ncclUniqueId id, int rank) { if (nranks != 1) return 5; *c = make(nranks, rank, &id); return 0; }
int ncclCommInitRankConfig(comm_t** c, int nranks, ncclUniqueId id, int rank, cfg_head* cfg) {
    if (cfg->magic != 0xcafebeef) return 4;
    *c = make(nranks, rank, &id);
    (*c)->blocking = cfg->blocking;
    return cfg->blocking == 0 ? 7 : ((*c)->state == 0 ? 0 : 5);
}
int ncclCommGetAsyncError(comm_t* c, int* st) { progress(c); *st = (getenv("SIM_NCCL_ASYNC_ERROR") && c->ops > 0) ? 6 : c->state; return 0; }
/* ncclCommSplit (NCCL >= 2.18) for a one-rank parent: color -1 (NCCL_SPLIT_NOCOLOR) gives no
 * communicator, any other color a one-rank one (in progress on a non-blocking config, like init).
 * Built without it (-DSIM_NO_SPLIT) to stand for a library that lacks the call. */
#ifndef SIM_NO_SPLIT
int ncclCommSplit(comm_t* c, int color, int key, comm_t** out, cfg_head* cfg) {
    if (c->state != 0 || c->nranks != 1) return 5;
    if (color == -1) { *out = NULL; return 0; }
    if (color < 0) return 4;
    ncclUniqueId id; memset(&id, 0, sizeof id); snprintf(id.internal, 64, "%s-split-%d-%d", c->key, color, key);
    *out = make(1, 0, &id);
    return cfg && cfg->blocking == 0 ? 7 : 0;
}
#endif
int ncclCommAbort(comm_t* c) { abort_calls++; free(c); return 0; }
int ncclCommFinalize(comm_t* c) { return 0; }
int ncclCommDestroy(comm_t* c) { destroy_calls++; free(c); return 0; }
int ncclCommCount(comm_t* c, int* n) { *n = c->nranks; return 0; }
int ncclCommCuDevice(comm_t* c, int* d) { *d = 0; return 0; }
int ncclCommUserRank(comm_t* c, int* r) { *r = c->rank; return 0; }
/* A collective: the copy, then (several ranks meeting in SIM_NCCL_RDZV_DIR) its completion once
 * every rank has made call number `ops`; a blocking communicator waits for that here. */
static int copy(const void* s, void* r, size_t bytes, comm_t* c) {
    if (c->state != 0) return 5;
    c->ops++;
    if (s != r) memmove(r, s, bytes);
    if (c->nranks == 1 || !getenv("SIM_NCCL_RDZV_DIR")) return 0;
    char p[512]; rdzv_op_file(c, c->rank, c->ops, p, sizeof p);
    FILE* f = fopen(p, "w"); if (f) fclose(f);
    c->waiting = c->ops; c->state = 7; progress(c);
    if (c->state == 0) return 0;
    if (c->blocking == 0) return 7;
    for (int i = 0; i < 60000 && c->state != 0; i++) { usleep(1000); progress(c); }
    return c->state == 0 ? 0 : 5;
}
/* SIM_CALL_LOG: as sim_cuda.c's call log, `ncclAllReduce STREAM`. */
static void log_call(const char* name, void* st) {
    const char* path = getenv("SIM_CALL_LOG");
    FILE* f = path ? fopen(path, "a") : 0;
    if (f) { fprintf(f, "%s %p\n", name, st); fclose(f); }
}
int ncclAllReduce(const void* s, void* r, size_t n, int dt, int op, comm_t* c, void* st) { log_call("ncclAllReduce", st); return copy(s, r, n * dsize(dt), c); }
int ncclBroadcast(const void* s, void* r, size_t n, int dt, int root, comm_t* c, void* st) { return copy(s, r, n * dsize(dt), c); }
int ncclReduce(const void* s, void* r, size_t n, int dt, int op, int root, comm_t* c, void* st) { return copy(s, r, n * dsize(dt), c); }
int ncclAllGather(const void* s, void* r, size_t n, int dt, comm_t* c, void* st) { return copy(s, r, n * dsize(dt), c); }
int ncclReduceScatter(const void* s, void* r, size_t n, int dt, int op, comm_t* c, void* st) { return copy(s, r, n * dsize(dt), c); }
int ncclSend(const void* b, size_t n, int dt, int peer, comm_t* c, void* st) { if (!in_group || peer != 0) return 5; sends[nsend] = b; send_bytes[nsend++] = n * dsize(dt); c->ops++; return 0; }
int ncclRecv(void* b, size_t n, int dt, int peer, comm_t* c, void* st) { if (!in_group || peer != 0) return 5; recvs[nrecv] = b; recv_bytes[nrecv++] = n * dsize(dt); return 0; }
int ncclGroupStart(void) { in_group++; return 0; }
int ncclGroupEnd(void) {
    if (--in_group > 0) return 0;
    if (nsend != nrecv) { nsend = nrecv = 0; return 5; }
    for (int i = 0; i < nsend; i++) { if (send_bytes[i] != recv_bytes[i]) return 4; memmove(recvs[i], sends[i], send_bytes[i]); }
    nsend = nrecv = 0;
    return 0;
}
