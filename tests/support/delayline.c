/* A delay line between two TUN devices, for WAN-like links on one machine (the kernel here has no
 * netem and no fq, so propagation delay cannot be added in tc).
 *
 * Every packet read from one device is written to the other after a fixed one-way delay; packets
 * going from A to B are dropped at random with a given probability. One thread per direction;
 * each keeps a FIFO of up to SLOTS packets (a full FIFO drops, like a full router queue). The
 * devices carry no offloads, so packets are MTU-sized and loss is per packet, as on a wire.
 *
 * A thread takes in everything waiting on its source device before it writes what is due, and
 * never sleeps longer than MAX_NAP_NS while packets are in flight: a packet's delay counts from
 * when it was read, so one left in the device's ring arrives late, and one that finds the ring full
 * is lost (the caller gives each device a ring far longer than the bottleneck queue as well).
 *
 *     delayline TUN_A TUN_B ONE_WAY_DELAY_US LOSS_A_TO_B_PERCENT SEED
 *
 * prints "ready" once both devices exist (the caller then moves them into namespaces and
 * configures them) and runs until killed, or until its parent dies: a test or benchmark killed
 * before its clean-up must not leave it running. Built and run by tests/support/wan.py.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/if_tun.h>
#include <net/if.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define SLOTS 16384
#define SLOT_BYTES 2048
#define BATCH 64               /* due packets written before looking for arrivals again */
#define MAX_NAP_NS 100000ull   /* longest sleep with packets in flight: arrivals wait at most this long */

struct direction {
    int src, dst;
    uint64_t delay_ns;
    double loss;
    unsigned seed;
    uint64_t due[SLOTS];
    int len[SLOTS];
    unsigned char *data;
    unsigned char scratch[SLOT_BYTES];
};

static int open_tun(const char *name) {
    int fd = open("/dev/net/tun", O_RDWR);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (fd < 0 || ioctl(fd, TUNSETIFF, &ifr) < 0 || fcntl(fd, F_SETFL, O_NONBLOCK) < 0) {
        perror(name);
        exit(1);
    }
    return fd;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Reads every packet waiting in the source device's ring (a full ring drops what the path was not
 * asked to lose), stamping each with its due time. */
static void take_arrivals(struct direction *d, unsigned head, unsigned *tail) {
    for (;;) {
        int full = *tail - head >= SLOTS;
        unsigned char *slot = full ? d->scratch : d->data + (size_t)(*tail % SLOTS) * SLOT_BYTES;
        ssize_t n = read(d->src, slot, SLOT_BYTES);
        if (n <= 0)
            return;
        if (full || (d->loss > 0 && (double)rand_r(&d->seed) / RAND_MAX < d->loss))
            continue;
        d->due[*tail % SLOTS] = now_ns() + d->delay_ns;
        d->len[*tail % SLOTS] = (int)n;
        (*tail)++;
    }
}

/* Writes up to BATCH packets that are due; returns whether more are due. */
static int send_due(struct direction *d, unsigned *head, unsigned tail) {
    uint64_t now = now_ns();
    for (int sent = 0; *head != tail && d->due[*head % SLOTS] <= now; sent++, (*head)++) {
        if (sent == BATCH)
            return 1;
        (void)!write(d->dst, d->data + (size_t)(*head % SLOTS) * SLOT_BYTES, (size_t)d->len[*head % SLOTS]);
    }
    return 0;
}

/* Sleeps until the oldest packet is due, MAX_NAP_NS at most, or with none in flight until one arrives. */
static void wait_for_work(struct direction *d, unsigned head, unsigned tail) {
    if (head == tail) {
        struct pollfd p = {d->src, POLLIN, 0};
        poll(&p, 1, -1);
        return;
    }
    uint64_t now = now_ns(), due = d->due[head % SLOTS];
    uint64_t nap = due <= now ? 0 : due - now < MAX_NAP_NS ? due - now : MAX_NAP_NS;
    struct timespec ts = {0, (long)nap};
    nanosleep(&ts, NULL);
}

static void *run(void *arg) {
    struct direction *d = arg;
    unsigned head = 0, tail = 0; /* packets [head, tail) wait for their due time */
    prctl(PR_SET_TIMERSLACK, 1000UL);
    for (;;) {
        take_arrivals(d, head, &tail);
        if (!send_due(d, &head, tail))
            wait_for_work(d, head, tail);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s TUN_A TUN_B ONE_WAY_DELAY_US LOSS_A_TO_B_PERCENT SEED\n", argv[0]);
        return 2;
    }
    pid_t parent = getppid();
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != parent)
        return 1; /* the parent is gone already */
    static struct direction ab, ba;
    ab.src = ba.dst = open_tun(argv[1]);
    ab.dst = ba.src = open_tun(argv[2]);
    ab.delay_ns = ba.delay_ns = (uint64_t)atoll(argv[3]) * 1000u;
    ab.loss = atof(argv[4]) / 100.0;
    ab.seed = (unsigned)atol(argv[5]);
    ba.seed = ab.seed + 1;
    ab.data = malloc((size_t)SLOTS * SLOT_BYTES);
    ba.data = malloc((size_t)SLOTS * SLOT_BYTES);
    if (!ab.data || !ba.data)
        return 1;
    printf("ready\n");
    fflush(stdout);
    pthread_t thread;
    pthread_create(&thread, NULL, run, &ab);
    run(&ba);
    return 0;
}
