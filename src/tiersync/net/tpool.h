/* A process-wide pool of helper threads for _local's parallel copies and sums.
 *
 * tp_run(fn, arg, threads) runs fn(arg) on the calling thread and on up to threads - 1 helpers
 * at once and returns when every one of them has returned. fn must share its work out by
 * itself (an atomic counter of units): a helper that comes late finds nothing left and returns
 * at once, so the job never waits for a helper to start.
 *
 * Why a pool: a thread created per call is placed by the scheduler's fork balancing, often
 * on the core the caller runs on, and starts tens to hundreds of microseconds late; on a small
 * host a 2-thread copy of a few MiB then ran at about one thread's speed (measured: 2.3-2.8 ms
 * of wall time for 3.1-3.3 ms of CPU per 24.5 MB call). Helpers that already exist are woken
 * where they last ran.
 *
 * One job at a time uses the pool (a caller that finds it busy, another Python thread's copy,
 * creates threads for its own job as before). Helpers are created on demand, at most
 * TP_MAX - 1, and live as long as the process; a forked child starts with an empty pool
 * (pthread_atfork), as its parent's helpers do not exist there. A helper that cannot be created
 * is not an error: the job runs on the threads there are.
 */
#ifndef TIERSYNC_TPOOL_H
#define TIERSYNC_TPOOL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define TP_MAX 16

typedef void *(*tp_fn)(void *);

static pthread_mutex_t tp_busy = PTHREAD_MUTEX_INITIALIZER; /* held by the job using the pool */
static pthread_mutex_t tp_mu = PTHREAD_MUTEX_INITIALIZER;   /* guards everything below */
static pthread_cond_t tp_work = PTHREAD_COND_INITIALIZER;   /* a new job was posted */
static pthread_cond_t tp_done = PTHREAD_COND_INITIALIZER;   /* a helper finished its part */
static size_t tp_helpers;                                   /* helpers alive */
static unsigned long tp_gen;                                /* jobs posted so far */
static tp_fn tp_job_fn;
static void *tp_job_arg;
static size_t tp_open, tp_running; /* places left in the current job; helpers inside it */

/* `first`: the number of jobs posted before the helper was created (it joins the next). */
static void *tp_helper(void *first) {
    unsigned long seen = (unsigned long)(uintptr_t)first;
    pthread_mutex_lock(&tp_mu);
    for (;;) {
        while (tp_gen == seen || tp_open == 0) {
            seen = tp_gen;
            pthread_cond_wait(&tp_work, &tp_mu);
        }
        seen = tp_gen;
        tp_open--, tp_running++;
        tp_fn fn = tp_job_fn;
        void *arg = tp_job_arg;
        pthread_mutex_unlock(&tp_mu);
        fn(arg);
        pthread_mutex_lock(&tp_mu);
        if (--tp_running == 0) pthread_cond_signal(&tp_done);
    }
    return NULL;
}

/* The child of a fork has none of its parent's helpers and no job. */
static void tp_after_fork(void) {
    pthread_mutex_init(&tp_busy, NULL);
    pthread_mutex_init(&tp_mu, NULL);
    pthread_cond_init(&tp_work, NULL);
    pthread_cond_init(&tp_done, NULL);
    tp_helpers = 0, tp_open = 0, tp_running = 0;
}

static void tp_init(void) { pthread_atfork(NULL, NULL, tp_after_fork); }

/* fn(arg) on threads created for this job only (the pool is busy). */
static void tp_run_own(tp_fn fn, void *arg, size_t threads) {
    pthread_t ids[TP_MAX];
    size_t started = 0;
    for (size_t i = 1; i < threads && started < TP_MAX; i++) {
        if (pthread_create(&ids[started], NULL, fn, arg) != 0) break;
        started++;
    }
    fn(arg);
    for (size_t i = 0; i < started; i++) pthread_join(ids[i], NULL);
}

static void tp_run(tp_fn fn, void *arg, size_t threads) {
    if (threads > TP_MAX) threads = TP_MAX;
    if (threads <= 1) {
        fn(arg);
        return;
    }
    if (pthread_mutex_trylock(&tp_busy) != 0) {
        tp_run_own(fn, arg, threads);
        return;
    }
    pthread_mutex_lock(&tp_mu);
    while (tp_helpers < threads - 1) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&id, &attr, tp_helper, (void *)(uintptr_t)tp_gen);
        pthread_attr_destroy(&attr);
        if (failed) break;
        tp_helpers++;
    }
    tp_job_fn = fn, tp_job_arg = arg, tp_open = threads - 1, tp_gen++;
    pthread_cond_broadcast(&tp_work);
    pthread_mutex_unlock(&tp_mu);
    fn(arg);
    pthread_mutex_lock(&tp_mu);
    tp_open = 0; /* closed: a helper that wakes from now on leaves this job alone */
    while (tp_running > 0) pthread_cond_wait(&tp_done, &tp_mu);
    pthread_mutex_unlock(&tp_mu);
    pthread_mutex_unlock(&tp_busy);
}

#endif
