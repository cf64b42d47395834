/*
 * Pinning the calling thread to one CPU, for the baselines that time cores against each other
 * (membw.c, xfloor.c). A CPU that cannot be had ends the program (exit 2): its figures would be
 * of some other placement. Include after defining _GNU_SOURCE.
 */
#ifndef LOCKSTEP_BASELINE_PIN_H
#define LOCKSTEP_BASELINE_PIN_H

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>

/* Pin this thread to `cpu`, or exit 2 with "`prog`: cannot pin ... `hint`". */
static void pin_to_cpu(int cpu, const char *prog, const char *hint) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    if (pthread_setaffinity_np(pthread_self(), sizeof s, &s)) {
        fprintf(stderr, "%s: cannot pin a thread to cpu %d%s\n", prog, cpu, hint);
        exit(2);
    }
}

#endif
