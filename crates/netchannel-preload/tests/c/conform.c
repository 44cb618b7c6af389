/* Socket semantics that programs rely on, printed as lines that must be identical under
 * `netchannel run` and on plain kernel TCP. Every line is fixed by the socket contract (counts,
 * booleans, errno names, poll masks), never by timing or by how bytes are segmented.
 *
 *   conform server PORT              threads serve commands (see serve()) on PORT, forked
 *                                    children on PORT+2 (see forkserver()), a listener that
 *                                    accepts only when told on PORT+3 (see held_server());
 *                                    PORT+1 stays free
 *   conform client HOST PORT
 *   conform unreachable HOST PORT
 *   conform scm-nolib HOST PORT      SCM_RIGHTS to a process without the library (kernel TCP)
 *   conform elide HOST PORT          one thread's level-triggered epoll loop (see elide())
 *   conform herd HOST PORT           threads polling idle connections beside a busy one
 *   conform rounds fork|spawn|child|scm HOST PORT N
 *                                    N rounds with the forking server (forkserver_round()), of
 *                                    a connection lent to a spawned program (spawn_round()) or
 *                                    to a forked child (child_round()), or passed by
 *                                    SCM_RIGHTS (scm_round())
 * Internal modes: exec-child FD, spawn-child, scm-recv UNIXFD. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <limits.h>
#include <spawn.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

static void die(const char *what) { printf("FAIL %s: %s\n", what, strerror(errno)); exit(1); }

static int wait_ev(int ep, int ms) {
    struct epoll_event ev[4];
    return epoll_wait(ep, ev, 4, ms);
}

/* Written by 'g' (on any connection): releases the connection held by 'L'. */
static int release[2] = {-1, -1};
/* Written by 'A' N (on any connection): the listener on PORT+3 accepts N connections. */
static int held_go[2] = {-1, -1};
/* Written by a connection in 'W' mode when it reads its end of stream; read by 'K'. */
static int eof_note[2] = {-1, -1};

/* Commands: 'd' send 10 bytes; 's' shut down writing; 'e' echo 4 bytes; 'q' quit; 'h' hold
 * (read nothing more: partial writes); 'w' read to EOF, then answer "done"; 'f' answer whether
 * accept4 made the fd close-on-exec and non-blocking; 'x' close at once (FIN); 'r' reset
 * (SO_LINGER {1, 0}, close); 'p' send 5 bytes; 'l' send 10 bytes after 300 ms; 'E' echo
 * everything to EOF, then close; 'L' read nothing until released by a 'g', then read to EOF;
 * 'Z' answer "z", then stop the whole process for 1.5 s; 'W' read to EOF, then note it; 'K'
 * answer "eof" once a 'W' connection noted its end of stream within 3 s, else "---". */
static void *serve(void *arg) {
    int c = (int)(long)arg;
    int fdflags = fcntl(c, F_GETFD), flflags = fcntl(c, F_GETFL);
    fcntl(c, F_SETFL, flflags & ~O_NONBLOCK);
    char cmd;
    while (read(c, &cmd, 1) == 1) {
        if (cmd == 'd') write(c, "0123456789", 10);
        if (cmd == 's') shutdown(c, SHUT_WR);
        if (cmd == 'e') { char b[4]; int n = 0; while (n < 4) { int r = read(c, b + n, 4 - n); if (r <= 0) break; n += r; } write(c, b, 4); }
        if (cmd == 'q') exit(0);
        if (cmd == 'h') { sleep(1); break; }
        if (cmd == 'w') { char b[256]; while (read(c, b, sizeof b) > 0) {} write(c, "done", 4); break; }
        if (cmd == 'f') { char r[2] = {(fdflags & FD_CLOEXEC) ? '1' : '0', (flflags & O_NONBLOCK) ? '1' : '0'}; write(c, r, 2); }
        if (cmd == 'x') break;
        if (cmd == 'r') { struct linger lg = {1, 0}; setsockopt(c, SOL_SOCKET, SO_LINGER, &lg, sizeof lg); break; }
        if (cmd == 'p') write(c, "01234", 5);
        if (cmd == 'U') { write(c, "abc", 3); send(c, "!", 1, MSG_OOB); write(c, "def", 3); }
        if (cmd == 'V') send(c, "xyz#", 4, MSG_OOB);
        if (cmd == 'l') { usleep(300000); write(c, "0123456789", 10); }
        if (cmd == 'E') {
            char b[16384]; ssize_t r;
            while ((r = read(c, b, sizeof b)) > 0)
                for (ssize_t o = 0; o < r;) { ssize_t w = write(c, b + o, r - o); if (w <= 0) break; o += w; }
            break;
        }
        if (cmd == 'L') {
            /* A locked receive buffer: kernel TCP's autotuning (or pruning) must not reopen,
             * seconds later on a loaded machine, the window the client has filled. */
            int small = 1 << 16;
            setsockopt(c, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
            char g, b[65536]; read(release[0], &g, 1); while (read(c, b, sizeof b) > 0) {} break;
        }
        if (cmd == 'g') write(release[1], "g", 1);
        if (cmd == 'W') { char b[256]; while (read(c, b, sizeof b) > 0) {} write(eof_note[1], "e", 1); break; }
        if (cmd == 'K') {
            struct pollfd n = {.fd = eof_note[0], .events = POLLIN};
            char e;
            int seen = poll(&n, 1, 3000) == 1 && read(eof_note[0], &e, 1) == 1;
            write(c, seen ? "eof" : "---", 3);
        }
        if (cmd == 'A') { char n; if (read(c, &n, 1) == 1) write(held_go[1], &n, 1); }
        if (cmd == 'Z') {
            /* The whole server process stops for 1.5 s (its engine too, when carried). */
            if (fork() == 0) { usleep(1500000); kill(getppid(), SIGCONT); _exit(0); }
            write(c, "z", 1);
            kill(getpid(), SIGSTOP);
        }
    }
    close(c);
    return NULL;
}

/* One process per connection on PORT+2, as inetd-style servers and PostgreSQL's postmaster do:
 * a thread of the server accepts, a forked child serves the connection, the parent closes its
 * copy at once (so the child's close alone ends the connection). In the server's process, not
 * a process of its own: the server's engine carries it. */
static void *forkserver(void *arg) {
    int l = (int)(long)arg;
    for (;;) {
        int c = accept(l, NULL, NULL);
        if (c < 0) { if (errno == EINTR) continue; die("accept"); }
        if (fork() == 0) { close(l); serve((void *)(long)c); _exit(0); }
        close(c);
    }
}

static int listener_backlog(int port, int backlog) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (bind(l, (void *)&a, sizeof a) || listen(l, backlog)) die("listen");
    return l;
}

static int listener(int port) { return listener_backlog(port, 16); }

/* PORT+3, backlog 1: accepts nothing until an 'A' N, then N connections, each served as on
 * PORT; then waits for the next 'A'. */
static void *held_server(void *arg) {
    int l = (int)(long)arg;
    for (;;) {
        char n;
        if (read(held_go[0], &n, 1) != 1) return NULL;
        for (int i = 0; i < n - '0'; i++) {
            int c = accept(l, NULL, NULL);
            if (c < 0) { if (errno == EINTR) { i--; continue; } die("accept held"); }
            pthread_t t;
            pthread_create(&t, NULL, serve, (void *)(long)c);
            pthread_detach(t);
        }
    }
}

static void server(int port) {
    /* PORT+3 first: a client that found PORT listening finds it too (no probe may reach it,
     * its backlog is for the test's connections alone). */
    int held = listener_backlog(port + 3, 1);
    int l = listener(port);
    if (pipe(release) || pipe(held_go) || pipe(eof_note)) die("pipe");
    signal(SIGCHLD, SIG_IGN); /* the forked servers' children are reaped by the kernel */
    pthread_t fs, hs;
    pthread_create(&fs, NULL, forkserver, (void *)(long)listener(port + 2));
    pthread_create(&hs, NULL, held_server, (void *)(long)held);
    for (;;) {
        /* Accepted here, served by another thread. */
        int c = accept4(l, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0) die("accept4");
        pthread_t t;
        pthread_create(&t, NULL, serve, (void *)(long)c);
        pthread_detach(t);
    }
}

static int dial(const char *host, int port, int nonblock);
static int pass_fd(int s, char *const argv[]);
/* Whether `pass_fd`'s receiver writes to /dev/null instead of stdout (its line, in rounds). */
static int quiet_receiver;
static void raw_syscalls(const char *host, int port);
static void connect_in_progress(const char *host, int port);

/* The result of the read that ended `read_full` short (0: end of stream, -1: errno), for a line
 * that shows why; never printed when every byte came, so kernel and carried lines still match. */
static ssize_t short_read;
static int short_errno;

static int read_full(int s, char *b, int len) {
    int got = 0;
    while (got < len) {
        ssize_t r = read(s, b + got, len - got);
        if (r <= 0) { short_read = r; short_errno = errno; break; }
        got += r;
    }
    return got;
}

static const char *en(int e);

/* " (short: RESULT)" after a read_full that got `n` of `want` bytes; "" when it got them all. */
static const char *why_short(int n, int want) {
    static char b[64];
    if (n >= want) return "";
    if (short_read < 0) snprintf(b, sizeof b, " (short: -1 %s)", en(short_errno));
    else snprintf(b, sizeof b, " (short: end of stream)");
    return b;
}

static volatile sig_atomic_t pipes, alarms;
static void on_pipe(int sig) { (void)sig; pipes++; }
static void on_alarm(int sig) { (void)sig; alarms++; }

/* After exec: the inherited carried fd still works. */
static void exec_child(int s) {
    char b[4];
    write(s, "eexec", 5);
    printf("exec child echo: %.*s\n", read_full(s, b, 4), b);
}

/* Semantics on one blocking connection: vectored and message I/O, the poll family, dup3,
 * names, TCP_INFO, EINTR, close-on-exec across exec, shutdown of our writing half. */
static void more(const char *host, int port, const char *self) {
    int s = dial(host, port, 0);
    if (s < 0) { errno = -s; die("connect"); }
    char b[64];
    write(s, "f", 1);
    printf("accept4 flags cloexec,nonblock: %.*s\n", read_full(s, b, 2), b);

    struct iovec wv[3] = {{"e", 1}, {"wx", 2}, {"yz", 2}};
    printf("writev: %zd\n", writev(s, wv, 3));
    char r1[2], r2[2];
    struct iovec rv[2] = {{r1, 2}, {r2, 2}};
    ssize_t n = readv(s, rv, 2);
    if (n == 2) n += read(s, r2, 2);
    printf("readv: %zd %.2s%.2s\n", n, r1, r2);

    struct iovec mv[2] = {{"e", 1}, {"msgs", 4}};
    struct msghdr mh = {.msg_iov = mv, .msg_iovlen = 2};
    printf("sendmsg: %zd\n", sendmsg(s, &mh, MSG_NOSIGNAL));
    char m[4];
    struct iovec mr = {m, 4};
    struct msghdr rh = {.msg_iov = &mr, .msg_iovlen = 1};
    printf("recvmsg: %zd %.4s\n", recvmsg(s, &rh, MSG_WAITALL), m);

    write(s, "d", 1);
    struct pollfd p = {.fd = s, .events = POLLIN};
    struct timespec ts = {5, 0};
    int pr = ppoll(&p, 1, &ts, NULL); /* called apart: argument order is unspecified */
    printf("ppoll: %d revents_in=%d\n", pr, !!(p.revents & POLLIN));
    fd_set rs; FD_ZERO(&rs); FD_SET(s, &rs);
    printf("pselect: %d\n", pselect(s + 1, &rs, NULL, NULL, &ts, NULL));
    printf("read 10: %d\n", read_full(s, b, 10));

    int d = dup3(s, 900, O_CLOEXEC);
    printf("dup3: %d cloexec=%d\n", d, !!(fcntl(900, F_GETFD) & FD_CLOEXEC));
    write(900, "edup3", 5);
    printf("echo via dup3: %.*s\n", read_full(900, b, 4), b);
    close(900);
    int dd = dup(s);
    close(s);
    s = dd;
    write(s, "edupd", 5);
    printf("echo via dup after closing the original: %.*s\n", read_full(s, b, 4), b);

    struct sockaddr_in sa; socklen_t sl = sizeof sa;
    int gr = getsockname(s, (void *)&sa, &sl);
    printf("getsockname: %d family_inet=%d\n", gr, sa.sin_family == AF_INET);
    struct tcp_info ti; socklen_t tl = sizeof ti;
    int tr = getsockopt(s, IPPROTO_TCP, TCP_INFO, &ti, &tl);
    printf("TCP_INFO: %d established=%d\n", tr, ti.tcpi_state == TCP_ESTABLISHED);
    int one = 1;
    printf("TCP_NODELAY: %d\n", setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one));

    /* EINTR: a blocking read interrupted by a signal without SA_RESTART. */
    struct sigaction sa_alarm = {.sa_handler = on_alarm};
    sigaction(SIGALRM, &sa_alarm, NULL);
    ualarm(100000, 0);
    ssize_t ri = read(s, b, 1);
    printf("read interrupted: %zd EINTR=%d alarms=%d\n", ri, errno == EINTR, (int)alarms);

    /* exec: the fd survives (no close-on-exec) and works in the new image. */
    char fd[16]; snprintf(fd, sizeof fd, "%d", s);
    pid_t pid = fork();
    if (pid == 0) { execl(self, "conform", "exec-child", fd, (char *)NULL); _exit(127); }
    int status = 0;
    waitpid(pid, &status, 0);
    printf("exec child exit: %d\n", WEXITSTATUS(status));

    /* Our writing half shut down: the peer reads EOF and can still answer. */
    write(s, "w", 1);
    write(s, "tail", 4);
    printf("shutdown(SHUT_WR): %d\n", shutdown(s, SHUT_WR));
    printf("answer after our shutdown: %.*s\n", read_full(s, b, 4), b);
    printf("then EOF: %zd\n", read(s, b, sizeof b));
    close(s);

    /* Our FIN acknowledged while the peer holds its end open ('h': a second): FIN_WAIT2
     * (looked at for up to half a second: acknowledgements may be delayed). */
    s = dial(host, port, 0);
    write(s, "h", 1);
    shutdown(s, SHUT_WR);
    int fin_wait2 = 0;
    for (int i = 0; i < 50 && !fin_wait2; i++) {
        tl = sizeof ti;
        getsockopt(s, IPPROTO_TCP, TCP_INFO, &ti, &tl);
        fin_wait2 = ti.tcpi_state == TCP_FIN_WAIT2;
        if (!fin_wait2) usleep(10000);
    }
    printf("TCP_INFO after our FIN: fin_wait2=%d\n", fin_wait2);
    close(s);

    /* SIGPIPE: writing to a connection the peer closed raises it (without MSG_NOSIGNAL). */
    struct sigaction sa_pipe = {.sa_handler = on_pipe};
    sigaction(SIGPIPE, &sa_pipe, NULL);
    s = dial(host, port, 0);
    write(s, "x", 1);
    usleep(100000);
    int failed = 0;
    for (int i = 0; i < 200 && !pipes; i++) {
        if (write(s, "...", 3) < 0) failed = 1;
        usleep(10000);
    }
    printf("sigpipe: caught=%d write failed=%d\n", pipes > 0, failed);
    signal(SIGPIPE, SIG_IGN);
    close(s);
}

static int dial(const char *host, int port, int nonblock) {
    int s = socket(AF_INET, SOCK_STREAM | (nonblock ? SOCK_NONBLOCK : 0), 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, host, &a.sin_addr);
    int rc = connect(s, (void *)&a, sizeof a);
    if (rc && errno != EINPROGRESS) return -errno;
    return s;
}

/* ---- More cases. Each group opens its own connections to `server` and closes them. ---- */

static const char *en(int e) {
    switch (e) {
    case 0: return "0";
    case EAGAIN: return "EAGAIN";
    case EINTR: return "EINTR";
    case EPIPE: return "EPIPE";
    case ECONNRESET: return "ECONNRESET";
    case ENOTCONN: return "ENOTCONN";
    case EBADF: return "EBADF";
    case ENOENT: return "ENOENT";
    case EINVAL: return "EINVAL";
    default: return strerror(e);
    }
}

/* A call's result: the count, or "-1 ERRNO". Call right after the call (errno). */
static const char *res(ssize_t r) {
    static char buf[8][32];
    static int i;
    char *b = buf[i++ % 8];
    if (r < 0) snprintf(b, 32, "-1 %s", en(errno));
    else snprintf(b, 32, "%zd", r);
    return b;
}

static int so_error(int s) {
    int e = -1; socklen_t l = sizeof e;
    getsockopt(s, SOL_SOCKET, SO_ERROR, &e, &l);
    return e;
}

static void cmd(int s, const char *c) { write(s, c, strlen(c)); }

/* Waits (up to 5 s) until `n` bytes are readable; returns how many are. */
static int wait_bytes(int s, int n) {
    int q = 0;
    for (int i = 0; i < 500; i++) {
        ioctl(s, FIONREAD, &q);
        if (q >= n) break;
        usleep(10000);
    }
    return q;
}

#define PMASK (POLLIN | POLLOUT | POLLERR | POLLHUP | POLLRDHUP)
#define EMASK (EPOLLIN | EPOLLOUT | EPOLLERR | EPOLLHUP | EPOLLRDHUP)

/* poll's revents (over PMASK) once any of `want` shows, or after 2 s. */
static int wait_revents(int s, int want) {
    struct pollfd p = {.fd = s, .events = POLLIN | POLLOUT | POLLRDHUP};
    for (int i = 0; i < 200; i++) {
        p.revents = 0;
        poll(&p, 1, 0);
        if (p.revents & want) break;
        usleep(10000);
    }
    /* What it settles to: kernel TCP's own reset is not one step (tcp_done sets TCP_CLOSE,
     * which poll shows as POLLHUP, before it shuts both halves, which adds POLLIN|POLLRDHUP),
     * and a poll between the two printed 0x1c for kernel TCP once. */
    usleep(10000);
    p.revents = 0;
    poll(&p, 1, 0);
    return p.revents & PMASK;
}

/* epoll's events (over EMASK) for one fd registered for EPOLLIN|EPOLLOUT|EPOLLRDHUP. */
static int epoll_mask(int s) {
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP}, out = {0};
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    int n = epoll_wait(ep, &out, 1, 1000);
    close(ep);
    return n == 1 ? (int)(out.events & EMASK) : 0;
}

static double now(clockid_t c) {
    struct timespec t;
    clock_gettime(c, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* Sends until our buffers and the peer's window are full: the peer reads nothing, yet the
 * first EAGAIN is not the end (the send buffer grows by autotuning, data in flight is acked), so
 * until two rounds 100 ms apart take nothing more. */
static long fill(int s) {
    static char big[1 << 16];
    long total = 0;
    for (int idle = 0; idle < 2;) {
        long round = 0;
        ssize_t w;
        while ((w = send(s, big, sizeof big, MSG_NOSIGNAL | MSG_DONTWAIT)) > 0) round += w;
        if (errno != EAGAIN) return -1;
        total += round;
        idle = round ? 0 : idle + 1;
        usleep(100000);
    }
    return total;
}

/* SO_LINGER with a time: close waits until the peer has every byte and the FIN, then returns
 * 0; here the peer reads nothing, the window is full and the server process is stopped for
 * 1.5 s, so the whole second. With a peer that reads, it returns as soon as it has them. */
static void linger_close(const char *host, int port) {
    int s = dial(host, port, 0), g = dial(host, port, 0);
    cmd(s, "L");
    fill(s);
    char z;
    cmd(g, "Z");
    read(g, &z, 1);
    usleep(50000);
    struct linger lg = {1, 1};
    setsockopt(s, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    double t0 = now(CLOCK_MONOTONIC);
    int rc = close(s);
    double waited = now(CLOCK_MONOTONIC) - t0;
    cmd(g, "g");
    close(g);
    printf("SO_LINGER 1 s, close on a full window: %d waited_the_linger_time=%d\n", rc,
           waited >= 0.9 && waited < 3);
    s = dial(host, port, 0);
    cmd(s, "w");
    static char kb[100000];
    long sent = 0;
    while (sent < (long)sizeof kb) { ssize_t w = write(s, kb + sent, sizeof kb - sent); if (w <= 0) break; sent += w; }
    lg = (struct linger){1, 5};
    setsockopt(s, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    t0 = now(CLOCK_MONOTONIC);
    rc = close(s);
    waited = now(CLOCK_MONOTONIC) - t0;
    printf("SO_LINGER 5 s, close with a peer that reads: %d returned_early=%d\n", rc, waited < 2);
}

struct waiter { int ep, n, done; unsigned events; };

static void *wait_out(void *arg) {
    struct waiter *w = arg;
    struct epoll_event ev;
    w->n = epoll_wait(w->ep, &ev, 1, 10000);
    w->events = w->n == 1 ? ev.events : 0;
    __atomic_store_n(&w->done, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

/* The same wait in poll(2): `ep` holds the socket. */
static void *poll_out(void *arg) {
    struct waiter *w = arg;
    struct pollfd p = {.fd = w->ep, .events = POLLOUT};
    w->n = poll(&p, 1, 10000);
    w->events = w->n == 1 ? (unsigned)p.revents : 0;
    __atomic_store_n(&w->done, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

/* A full window: a blocking send with SO_SNDTIMEO gives up with EAGAIN after the timeout;
 * a thread waiting for EPOLLOUT sleeps (uses no CPU) until the peer reads, then wakes. */
static void full_window(const char *host, int port) {
    int s = dial(host, port, 0);
    cmd(s, "L");
    long total = fill(s);
    printf("full window: filled=%d\n", total > 0);

    struct timeval tv = {0, 200000};
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    static char big[1 << 16];
    /* "Full" is the kernel's judgement of the moment: its send buffer can grow, or a window
     * probe reopen the window, after fill() saw EAGAIN (seen on a veth, where a blocking send
     * then took 64 KiB at once). What TCP promises is that a blocking send on a window that
     * stays full gives up after the timeout: EAGAIN, or the count it copied before (then the
     * next call has no room at all). Send until a call fails, at most 64 tries. */
    ssize_t r = 0;
    double waited = 0;
    for (int tries = 0; tries < 64 && r >= 0; tries++) {
        double t0 = now(CLOCK_MONOTONIC);
        r = send(s, big, sizeof big, MSG_NOSIGNAL);
        waited = now(CLOCK_MONOTONIC) - t0;
    }
    const char *rr = res(r);
    printf("SO_SNDTIMEO 200 ms on a full window: %s waited_timeout=%d\n", rr, waited >= 0.19 && waited < 2);

    /* A mixed set, a pipe ahead of the full socket: the socket is not writable. */
    int mp[2];
    pipe(mp);
    struct pollfd mixed[2] = {{.fd = mp[0], .events = POLLIN}, {.fd = s, .events = POLLOUT}};
    int mn = poll(mixed, 2, 100);
    printf("poll(pipe, full socket): %d revents %#x %#x\n", mn, mixed[0].revents, mixed[1].revents);
    close(mp[0]); close(mp[1]);

    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLOUT, .data.fd = s};
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    struct waiter w = {.ep = ep}, pw = {.ep = s};
    pthread_t t, pt;
    pthread_create(&t, NULL, wait_out, &w);
    pthread_create(&pt, NULL, poll_out, &pw);
    clockid_t cid, pcid;
    pthread_getcpuclockid(t, &cid);
    pthread_getcpuclockid(pt, &pcid);
    usleep(20000);
    double c0 = now(cid), pc0 = now(pcid), p0 = now(CLOCK_PROCESS_CPUTIME_ID);
    usleep(300000);
    double c1 = now(cid), pc1 = now(pcid), p1 = now(CLOCK_PROCESS_CPUTIME_ID);
    int still = !__atomic_load_n(&w.done, __ATOMIC_SEQ_CST);
    int pstill = !__atomic_load_n(&pw.done, __ATOMIC_SEQ_CST);
    printf("EPOLLOUT waiter over 300 ms of full window: still_waiting=%d cpu_low=%d process_cpu_low=%d\n",
           still, c1 - c0 < 0.05, p1 - p0 < 0.1);
    printf("POLLOUT waiter over 300 ms of full window: still_waiting=%d cpu_low=%d\n", pstill,
           pc1 - pc0 < 0.05);
    int g = dial(host, port, 0);
    cmd(g, "g");
    pthread_join(t, NULL);
    pthread_join(pt, NULL);
    printf("after the peer reads: epoll_wait=%d EPOLLOUT=%d poll=%d POLLOUT=%d\n", w.n,
           !!(w.events & EPOLLOUT), pw.n, !!(pw.events & POLLOUT));
    close(g); close(ep); close(s);
}

struct excl { int ep, ev, s, woke, bytes, reads; };

static void *excl_wait(void *arg) {
    struct excl *x = arg;
    for (;;) {
        struct epoll_event ev[2];
        int n = epoll_wait(x->ep, ev, 2, 5000), quit = n <= 0;
        for (int i = 0; i < n; i++) {
            if (ev[i].data.fd == x->ev) { quit = 1; continue; }
            __atomic_add_fetch(&x->woke, 1, __ATOMIC_SEQ_CST);
            char b[64];
            ssize_t r = recv(x->s, b, sizeof b, MSG_DONTWAIT);
            if (r > 0) { __atomic_add_fetch(&x->bytes, r, __ATOMIC_SEQ_CST); __atomic_add_fetch(&x->reads, 1, __ATOMIC_SEQ_CST); }
        }
        if (quit) return NULL;
    }
}

/* epoll: an edge per arrival (ET), one-shot re-armed by EPOLL_CTL_MOD, EPOLLEXCLUSIVE (at least
 * one waiter wakes), one fd in two sets (both report it), a registration that follows the open
 * file description (a dup keeps it alive after the original fd is closed; it is keyed by the
 * original fd number), and an epoll fd inside poll and select. */
static void epoll_cases(const char *host, int port) {
    int s = dial(host, port, 0);
    char b[64];
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLET, .data.fd = s}, out;
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    cmd(s, "d");
    wait_bytes(s, 10);
    int e1 = epoll_wait(ep, &out, 1, 2000), e2 = epoll_wait(ep, &out, 1, 0);
    cmd(s, "d");
    int e3 = epoll_wait(ep, &out, 1, 2000);
    printf("epoll ET two arrivals, not drained: first=%d idle=%d second=%d unread=%d\n", e1, e2, e3, wait_bytes(s, 20));
    read_full(s, b, 20);
    close(ep);

    ep = epoll_create1(0);
    ev = (struct epoll_event){.events = EPOLLIN | EPOLLONESHOT, .data.fd = s};
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    cmd(s, "d");
    e1 = epoll_wait(ep, &out, 1, 2000);
    e2 = epoll_wait(ep, &out, 1, 100);
    ev.events = EPOLLIN | EPOLLONESHOT;
    int m = epoll_ctl(ep, EPOLL_CTL_MOD, s, &ev);
    e3 = epoll_wait(ep, &out, 1, 1000);
    printf("epoll ONESHOT: first=%d disarmed=%d mod=%d rearmed=%d\n", e1, e2, m, e3);
    close(ep);

    /* Two sets over the same fd, 10 unread bytes: both report it. */
    int ep1 = epoll_create1(0), ep2 = epoll_create1(0);
    ev = (struct epoll_event){.events = EPOLLIN, .data.fd = s};
    epoll_ctl(ep1, EPOLL_CTL_ADD, s, &ev);
    epoll_ctl(ep2, EPOLL_CTL_ADD, s, &ev);
    e1 = epoll_wait(ep1, &out, 1, 1000);
    e2 = epoll_wait(ep2, &out, 1, 1000);
    printf("one fd in two epoll sets: %d %d\n", e1, e2);

    /* An epoll fd is readable in poll and select while it has events. */
    struct pollfd p = {.fd = ep1, .events = POLLIN};
    int pr = poll(&p, 1, 1000);
    fd_set rs; FD_ZERO(&rs); FD_SET(ep1, &rs);
    struct timeval tv = {1, 0};
    int sr = select(ep1 + 1, &rs, NULL, NULL, &tv);
    printf("epoll fd in poll: %d revents=%#x in select: %d isset=%d\n", pr, p.revents, sr, FD_ISSET(ep1, &rs));
    read_full(s, b, 10);
    p.revents = 0;
    pr = poll(&p, 1, 100);
    FD_ZERO(&rs); FD_SET(ep1, &rs);
    tv = (struct timeval){0, 100000};
    sr = select(ep1 + 1, &rs, NULL, NULL, &tv);
    printf("epoll fd without events in poll: %d in select: %d\n", pr, sr);
    close(ep1); close(ep2);

    /* EPOLLEXCLUSIVE in two sets, a thread on each: the data is read once. */
    struct excl x[2];
    pthread_t t[2];
    int wake = eventfd(0, 0);
    for (int i = 0; i < 2; i++) {
        x[i] = (struct excl){.ep = epoll_create1(0), .ev = wake, .s = s};
        ev = (struct epoll_event){.events = EPOLLIN | EPOLLEXCLUSIVE, .data.fd = s};
        epoll_ctl(x[i].ep, EPOLL_CTL_ADD, s, &ev);
        ev = (struct epoll_event){.events = EPOLLIN, .data.fd = wake};
        epoll_ctl(x[i].ep, EPOLL_CTL_ADD, wake, &ev);
        pthread_create(&t[i], NULL, excl_wait, &x[i]);
    }
    usleep(100000);
    cmd(s, "d");
    for (int i = 0; i < 300 && __atomic_load_n(&x[0].bytes, __ATOMIC_SEQ_CST) + __atomic_load_n(&x[1].bytes, __ATOMIC_SEQ_CST) < 10; i++)
        usleep(10000);
    usleep(50000);
    eventfd_write(wake, 1);
    for (int i = 0; i < 2; i++) { pthread_join(t[i], NULL); close(x[i].ep); }
    close(wake);
    printf("EPOLLEXCLUSIVE in two sets: woke_any=%d bytes=%d reads_with_data=%d\n",
           x[0].woke + x[1].woke > 0, x[0].bytes + x[1].bytes, x[0].reads + x[1].reads);

    /* The registration belongs to the open file description: a dup keeps it reporting. */
    int d = dup(s);
    ep = epoll_create1(0);
    ev = (struct epoll_event){.events = EPOLLIN, .data.fd = s};
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    int orig = s;
    close(s);
    cmd(d, "d");
    out.data.fd = -1;
    e1 = epoll_wait(ep, &out, 1, 2000);
    printf("registered fd closed, dup open: epoll_wait=%d data_is_old_fd=%d\n", e1, out.data.fd == orig);
    printf("  EPOLL_CTL_DEL by the dup: %s", res(epoll_ctl(ep, EPOLL_CTL_DEL, d, NULL)));
    printf(" by the closed fd: %s\n", res(epoll_ctl(ep, EPOLL_CTL_DEL, orig, NULL)));
    read_full(d, b, 10);
    close(d);
    printf("  after the dup is closed too: %d\n", epoll_wait(ep, &out, 1, 100));
    close(ep);
}

/* SO_RCVLOWAT and peeks that wait: a blocking read waits for the low-water mark, poll and
 * epoll show readable only from it on (or at the end), a peek waits for it too, MSG_PEEK with
 * MSG_WAITALL waits for all it asked for, and a non-blocking read takes what is there. poll
 * never reports POLLWRBAND (TCP does not set it). */
static void low_water(const char *host, int port) {
    char b[64];
    int s = dial(host, port, 0), lw = 8, got = 0, one = 1;
    socklen_t gl = sizeof got;
    setsockopt(s, SOL_SOCKET, SO_RCVLOWAT, &lw, sizeof lw);
    getsockopt(s, SOL_SOCKET, SO_RCVLOWAT, &got, &gl);
    cmd(s, "p");
    int have = wait_bytes(s, 5);
    struct pollfd p = {.fd = s, .events = POLLIN | POLLOUT | POLLWRBAND};
    int pr = poll(&p, 1, 200);
    short before = p.revents;
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = s}, out[2];
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    int er = epoll_wait(ep, out, 2, 100);
    cmd(s, "l");
    p.events = POLLIN;
    int pr2 = poll(&p, 1, 2000);
    int er2 = epoll_wait(ep, out, 2, 2000);
    ssize_t n = recv(s, b, sizeof b, 0);
    printf("rcvlowat %d, %d bytes: poll %d %#x, epoll %d; 15 bytes: poll %d %#x, epoll %d; recv %zd\n",
           got, have, pr, before, er, pr2, p.revents, er2, n);
    close(ep);
    int mp[2];
    pipe(mp);
    struct pollfd mx[2] = {{.fd = mp[0], .events = POLLIN}, {.fd = s, .events = POLLOUT | POLLWRBAND}};
    int mr = poll(mx, 2, 0);
    printf("poll(pipe, socket) asking POLLWRBAND: %d %#x", mr, mx[1].revents);
    int wep = epoll_create1(0);
    struct epoll_event wev = {.events = EPOLLOUT | EPOLLWRBAND, .data.fd = s}, wout[2];
    epoll_ctl(wep, EPOLL_CTL_ADD, s, &wev);
    int wn = epoll_wait(wep, wout, 2, 100);
    printf(", epoll: %d %#x\n", wn, wn > 0 ? wout[0].events : 0);
    close(wep);
    close(mp[0]); close(mp[1]);
    cmd(s, "pl");
    n = recv(s, b, sizeof b, 0);
    printf("rcvlowat: a blocking read of 5 + 10 bytes returns %zd\n", n);
    cmd(s, "pl");
    ssize_t pk = recv(s, b, sizeof b, MSG_PEEK);
    n = recv(s, b, sizeof b, 0);
    printf("rcvlowat: peek %zd, then read %zd\n", pk, n);
    cmd(s, "p");
    wait_bytes(s, 5);
    n = recv(s, b, sizeof b, MSG_DONTWAIT);
    printf("rcvlowat: non-blocking read below the mark %zd\n", n);
    setsockopt(s, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    cmd(s, "pl");
    pk = recv(s, b, 12, MSG_PEEK | MSG_WAITALL);
    int fion = 0;
    ioctl(s, FIONREAD, &fion);
    n = recv(s, b, 12, MSG_WAITALL);
    ssize_t rest = recv(s, b, sizeof b, 0);
    printf("peek+waitall 12: %zd (FIONREAD %d), then waitall read %zd, then %zd\n", pk, fion, n, rest);
    /* What a waiting peek took ahead is still there for a forked child that reads the
     * inherited connection. */
    cmd(s, "d");
    pk = recv(s, b, 10, MSG_PEEK | MSG_WAITALL);
    pid_t child = fork();
    if (child == 0) {
        alarm(5);
        _exit(read_full(s, b, 10) == 10 && memcmp(b, "0123456789", 10) == 0 ? 0 : 1);
    }
    int st = 0;
    waitpid(child, &st, 0);
    printf("peek+waitall 10, then a forked child reads: %zd, child %s\n", pk,
           WIFEXITED(st) && WEXITSTATUS(st) == 0 ? "read all 10" : "did not");
    close(s);
}

/* Timeouts as the kernel reads them: select carries microseconds beyond a second into the
 * seconds; a negative time (or nanoseconds out of range) is EINVAL for select, pselect and
 * ppoll. */
static void wait_timeouts(const char *host, int port) {
    int s = dial(host, port, 0);
    fd_set rs;
    FD_ZERO(&rs); FD_SET(s, &rs);
    struct timeval tv = {0, 1200000};
    double t0 = now(CLOCK_MONOTONIC);
    int n = select(s + 1, &rs, NULL, NULL, &tv);
    printf("select 1,200,000 us on an idle socket: %d waited_1.2_s=%d", n,
           now(CLOCK_MONOTONIC) - t0 >= 1.15);
    FD_ZERO(&rs); FD_SET(s, &rs);
    tv = (struct timeval){0, -1};
    printf(", usec -1: %s", res(select(s + 1, &rs, NULL, NULL, &tv)));
    FD_ZERO(&rs); FD_SET(s, &rs);
    struct timespec bad = {-1, 0}, badns = {0, 1000000000};
    printf(", pselect sec -1: %s", res(pselect(s + 1, &rs, NULL, NULL, &bad, NULL)));
    struct pollfd p = {.fd = s, .events = POLLIN};
    printf(", ppoll nsec 1e9: %s\n", res(ppoll(&p, 1, &badns, NULL)));
    close(s);
}

/* A NULL buffer with a length: EFAULT only once there are bytes to copy (they stay unread);
 * before, what any read finds: EAGAIN when it may not wait, else a wait; 0 at the end. */
static void null_buffer(const char *host, int port) {
    char b[64];
    int s = dial(host, port, 0);
    printf("NULL buffer, nothing there: non-blocking %s", res(recv(s, NULL, 10, MSG_DONTWAIT)));
    cmd(s, "l");
    double t0 = now(CLOCK_MONOTONIC);
    printf(", blocking %s", res(recv(s, NULL, 10, 0)));
    printf(" after_the_bytes=%d", now(CLOCK_MONOTONIC) - t0 >= 0.2);
    printf(", then read %s", res(read_full(s, b, 10)));
    cmd(s, "x");
    wait_revents(s, POLLIN);
    printf(", at the end %s\n", res(recv(s, NULL, 10, 0)));
    close(s);
}

/* poll and select over a carried socket, a pipe and a UDP socket: exactly the ready ones. */
static void mixed_sets(const char *host, int port) {
    int s = dial(host, port, 0), pp[2], u = socket(AF_INET, SOCK_DGRAM, 0);
    pipe(pp);
    struct sockaddr_in ua = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &ua.sin_addr);
    bind(u, (void *)&ua, sizeof ua);
    int fds[3] = {s, pp[0], u}, max = 0;
    for (int i = 0; i < 3; i++) if (fds[i] > max) max = fds[i];
    char b[64];
    for (int round = 0; round < 2; round++) {
        if (round == 0) write(pp[1], "p", 1);
        else { read(pp[0], b, 1); cmd(s, "d"); wait_bytes(s, 10); }
        struct pollfd p[3];
        for (int i = 0; i < 3; i++) p[i] = (struct pollfd){.fd = fds[i], .events = POLLIN};
        int pr = poll(p, 3, 1000);
        fd_set rs; FD_ZERO(&rs);
        for (int i = 0; i < 3; i++) FD_SET(fds[i], &rs);
        struct timeval tv = {1, 0};
        int sr = select(max + 1, &rs, NULL, NULL, &tv);
        printf("mixed, %s ready: poll=%d revents socket=%#x pipe=%#x udp=%#x select=%d isset %d%d%d\n",
               round ? "socket" : "pipe", pr, p[0].revents, p[1].revents, p[2].revents, sr,
               FD_ISSET(s, &rs), FD_ISSET(pp[0], &rs), FD_ISSET(u, &rs));
    }
    read_full(s, b, 10);
    /* A wait that sleeps until the socket's bytes come (sent 300 ms later), in poll and in
     * select; then one until the peer's FIN. */
    for (int round = 0; round < 3; round++) {
        cmd(s, round < 2 ? "l" : "s");
        int ready;
        if (round != 1) {
            struct pollfd p[3];
            for (int i = 0; i < 3; i++) p[i] = (struct pollfd){.fd = fds[i], .events = POLLIN};
            ready = poll(p, 3, 3000);
            printf("mixed, sleeping until %s: poll=%d revents socket=%#x pipe=%#x udp=%#x",
                   round ? "FIN" : "data", ready, p[0].revents, p[1].revents, p[2].revents);
        } else {
            fd_set rs; FD_ZERO(&rs);
            for (int i = 0; i < 3; i++) FD_SET(fds[i], &rs);
            struct timeval tv = {3, 0};
            ready = select(max + 1, &rs, NULL, NULL, &tv);
            printf("mixed, sleeping until data: select=%d isset %d%d%d", ready, FD_ISSET(s, &rs),
                   FD_ISSET(pp[0], &rs), FD_ISSET(u, &rs));
        }
        printf(" read %d\n", round < 2 ? read_full(s, b, 10) : (int)read(s, b, sizeof b));
    }
    close(s); close(pp[0]); close(pp[1]); close(u);
}

/* The peer's FIN, then our write to the closed peer (it answers RST: this socket was in
 * CLOSE_WAIT, so Linux reports EPIPE); the peer's RST (SO_LINGER {1, 0}): the error is reported
 * once, by whichever of recv or SO_ERROR comes first, then reads give 0 and sends EPIPE; bytes
 * that arrived before the RST are read first. */
static void fin_and_reset(const char *host, int port) {
    int s = dial(host, port, 0);
    char b[64];
    cmd(s, "x");
    int rv = wait_revents(s, POLLIN);
    printf("after FIN: poll=%#x epoll=%#x", rv, epoll_mask(s));
    printf(" recv=%s", res(recv(s, b, sizeof b, 0)));
    printf(" recv=%s", res(recv(s, b, sizeof b, 0)));
    printf(" so_error=%s\n", en(so_error(s)));
    printf("  send to the closed peer: %s", res(send(s, "abc", 3, MSG_NOSIGNAL)));
    rv = wait_revents(s, POLLHUP | POLLERR);
    printf(" then poll=%#x epoll=%#x", rv, epoll_mask(s));
    printf(" recv=%s", res(recv(s, b, sizeof b, 0)));
    printf(" so_error=%s", en(so_error(s)));
    printf(" send=%s\n", res(send(s, "abc", 3, MSG_NOSIGNAL)));
    close(s);

    s = dial(host, port, 0);
    cmd(s, "r");
    rv = wait_revents(s, POLLHUP | POLLERR);
    printf("after RST: poll=%#x epoll=%#x", rv, epoll_mask(s));
    printf(" recv=%s", res(recv(s, b, sizeof b, 0)));
    printf(" recv=%s", res(recv(s, b, sizeof b, 0)));
    printf(" so_error=%s", en(so_error(s)));
    printf(" send=%s", res(send(s, "abc", 3, MSG_NOSIGNAL)));
    printf(" then poll=%#x epoll=%#x\n", wait_revents(s, POLLHUP), epoll_mask(s));
    close(s);

    /* Bytes that arrived before the reset are still read, then the error (the kernel keeps
     * its receive queue on a reset). */
    s = dial(host, port, 0);
    cmd(s, "p");
    wait_bytes(s, 5);
    cmd(s, "r");
    rv = wait_revents(s, POLLHUP | POLLERR);
    printf("5 bytes, then RST: poll=%#x epoll=%#x", rv, epoll_mask(s));
    printf(" recv=%s", res(recv(s, b, 3, 0)));
    printf(" recv=%s", res(recv(s, b, sizeof b, 0)));
    printf(" recv=%s", res(recv(s, b, sizeof b, 0)));
    printf(" recv=%s\n", res(recv(s, b, sizeof b, 0)));
    close(s);

    s = dial(host, port, 0);
    cmd(s, "r");
    wait_revents(s, POLLHUP | POLLERR);
    printf("after RST, SO_ERROR first: so_error=%s", en(so_error(s)));
    printf(" so_error=%s", en(so_error(s)));
    printf(" recv=%s", res(recv(s, b, sizeof b, 0)));
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    printf(" getpeername=%s\n", res(getpeername(s, (struct sockaddr *)&ss, &sl)));
    close(s);

    /* An empty send after our own SHUT_WR fails as any write does (EPIPE and SIGPIPE); an
     * empty writev never reaches the socket (0). */
    s = dial(host, port, 0);
    shutdown(s, SHUT_WR);
    struct sigaction sa_pipe = {.sa_handler = on_pipe};
    sigaction(SIGPIPE, &sa_pipe, NULL);
    int p0 = pipes;
    struct iovec none = {b, 0};
    printf("empty writes after SHUT_WR: send=%s", res(send(s, b, 0, 0)));
    printf(" sigpipe=%d", pipes - p0);
    printf(" writev=%s\n", res(writev(s, &none, 1)));
    close(s);

    /* The peer's FIN, then its RST (answering our write): SO_ERROR says EPIPE (the reset came
     * in CLOSE_WAIT), and a write without MSG_NOSIGNAL fails with EPIPE and raises SIGPIPE. */
    s = dial(host, port, 0);
    cmd(s, "x");
    wait_revents(s, POLLIN);
    send(s, "abc", 3, MSG_NOSIGNAL);
    wait_revents(s, POLLHUP | POLLERR);
    p0 = pipes;
    printf("RST after FIN: so_error=%s", en(so_error(s)));
    printf(" send=%s", res(send(s, "abc", 3, 0)));
    printf(" sigpipe=%d\n", pipes - p0);
    signal(SIGPIPE, SIG_IGN);
    close(s);
}

/* SO_RCVTIMEO; signals: MSG_WAITALL interrupted after part of the data returns that part,
 * SA_RESTART restarts a blocking read, no SA_RESTART gives EINTR, and SA_RESTART on a socket
 * with a receive timeout gives EINTR too (Linux: socket timeouts make restarts EINTR). */
static void timeouts_and_signals(const char *host, int port) {
    int s = dial(host, port, 0);
    char b[64];
    struct timeval tv = {0, 200000};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    double t0 = now(CLOCK_MONOTONIC);
    const char *r = res(recv(s, b, sizeof b, 0));
    double waited = now(CLOCK_MONOTONIC) - t0;
    printf("SO_RCVTIMEO 200 ms: recv=%s waited_timeout=%d\n", r, waited >= 0.19 && waited < 2);
    /* A negative timeout: the kernel keeps zero jiffies, so the read fails at once. */
    tv = (struct timeval){-1, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    t0 = now(CLOCK_MONOTONIC);
    r = res(recv(s, b, sizeof b, 0));
    waited = now(CLOCK_MONOTONIC) - t0;
    printf("SO_RCVTIMEO negative: recv=%s at_once=%d", r, waited < 0.1);
    printf(" recv0=%s\n", res(recv(s, b, 0, 0)));

    /* Options set before connect hold after it (a carried connection took them over). */
    {
        int t = socket(AF_INET, SOCK_STREAM, 0), one = 1, nodelay = 0;
        struct timeval before = {0, 200000};
        setsockopt(t, SOL_SOCKET, SO_RCVTIMEO, &before, sizeof before);
        setsockopt(t, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        int sndbuf = 65536, rcvbuf = 32768;
        setsockopt(t, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
        setsockopt(t, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
        inet_pton(AF_INET, host, &a.sin_addr);
        if (connect(t, (void *)&a, sizeof a)) die("connect");
        double t1 = now(CLOCK_MONOTONIC);
        const char *rr = res(recv(t, b, sizeof b, 0));
        double w = now(CLOCK_MONOTONIC) - t1;
        socklen_t nl = sizeof nodelay;
        getsockopt(t, IPPROTO_TCP, TCP_NODELAY, &nodelay, &nl);
        nl = sizeof sndbuf;
        getsockopt(t, SOL_SOCKET, SO_SNDBUF, &sndbuf, &nl);
        nl = sizeof rcvbuf;
        getsockopt(t, SOL_SOCKET, SO_RCVBUF, &rcvbuf, &nl);
        printf("set before connect: SO_RCVTIMEO 200 ms recv=%s waited_timeout=%d TCP_NODELAY=%d SO_SNDBUF=%d SO_RCVBUF=%d\n",
               rr, w >= 0.19 && w < 2, nodelay, sndbuf, rcvbuf);
        close(t);
    }

    /* Zero-length reads: read returns 0 at once; recv waits for something to read (EAGAIN
     * when it may not wait, or at its timeout), then returns 0 and leaves the data. */
    printf("zero-length: read=%s", res(read(s, b, 0)));
    printf(" recv_dontwait=%s", res(recv(s, b, 0, MSG_DONTWAIT)));
    tv = (struct timeval){0, 100000};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    t0 = now(CLOCK_MONOTONIC);
    r = res(recv(s, b, 0, 0));
    waited = now(CLOCK_MONOTONIC) - t0;
    printf(" recv_blocking=%s waited_timeout=%d", r, waited >= 0.09 && waited < 2);
    cmd(s, "p");
    wait_bytes(s, 5);
    printf(" with data: recv=%s", res(recv(s, b, 0, 0)));
    printf(" then read=%d\n", read_full(s, b, 5));
    tv = (struct timeval){0, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);

    /* NULL buffers and address lengths: EFAULT, except a recv that discards (MSG_TRUNC). */
    cmd(s, "p");
    wait_bytes(s, 5);
    printf("NULL: recv=%s", res(recv(s, NULL, 5, 0)));
    printf(" recv_trunc=%s", res(recv(s, NULL, 5, MSG_TRUNC)));
    printf(" send=%s", res(send(s, NULL, 5, MSG_NOSIGNAL)));
    struct sockaddr_storage nss;
    printf(" getpeername=%s", res(getpeername(s, (struct sockaddr *)&nss, NULL)));
    socklen_t nl = sizeof nss;
    printf(" getsockname=%s\n", res(getsockname(s, NULL, &nl)));

    /* recvmmsg: one read per message; without MSG_WAITFORONE the second waits for more bytes
     * (10 in 300 ms), with it the call returns after the first. */
    cmd(s, "p");
    wait_bytes(s, 5);
    cmd(s, "l");
    char m1[64], m2[64];
    struct iovec v1 = {m1, sizeof m1}, v2 = {m2, sizeof m2};
    struct mmsghdr mm[2] = {{.msg_hdr = {.msg_iov = &v1, .msg_iovlen = 1}},
                            {.msg_hdr = {.msg_iov = &v2, .msg_iovlen = 1}}};
    int mg = recvmmsg(s, mm, 2, 0, NULL);
    printf("recvmmsg blocking: %d lens %u %u", mg, mm[0].msg_len, mg > 1 ? mm[1].msg_len : 0);
    cmd(s, "p");
    wait_bytes(s, 5);
    mg = recvmmsg(s, mm, 2, MSG_WAITFORONE, NULL);
    printf(" waitforone: %d len %u", mg, mm[0].msg_len);
    struct timespec forever = {LONG_MAX, 0};
    cmd(s, "p");
    wait_bytes(s, 5);
    mg = recvmmsg(s, mm, 2, MSG_WAITFORONE, &forever);
    printf(" with a timeout of LONG_MAX s: %d len %u\n", mg, mm[0].msg_len);

    /* A NULL vector base with a length: EFAULT once there are bytes to copy. */
    cmd(s, "p");
    wait_bytes(s, 5);
    struct iovec nullv = {NULL, 5};
    printf("readv NULL base: %s", res(readv(s, &nullv, 1)));
    printf(" then read=%d\n", read_full(s, b, 5));

    struct sigaction plain = {.sa_handler = on_alarm}, restart = {.sa_handler = on_alarm, .sa_flags = SA_RESTART};
    sigaction(SIGALRM, &plain, NULL);
    cmd(s, "p");
    wait_bytes(s, 5);
    int a0 = alarms;
    ualarm(100000, 0);
    r = res(recv(s, b, 10, MSG_WAITALL));
    printf("MSG_WAITALL for 10, 5 arrived, interrupted: %s alarms=%d\n", r, alarms - a0);

    a0 = alarms;
    ualarm(100000, 0);
    r = res(recv(s, b, 10, 0));
    printf("blocking recv, no SA_RESTART: %s alarms=%d\n", r, alarms - a0);

    sigaction(SIGALRM, &restart, NULL);
    cmd(s, "l"); /* 10 bytes in 300 ms */
    a0 = alarms;
    ualarm(100000, 0);
    r = res(recv(s, b, 10, MSG_WAITALL));
    printf("blocking recv, SA_RESTART: %s alarms=%d\n", r, alarms - a0);

    tv = (struct timeval){2, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    a0 = alarms;
    ualarm(100000, 0);
    t0 = now(CLOCK_MONOTONIC);
    r = res(recv(s, b, 10, 0));
    waited = now(CLOCK_MONOTONIC) - t0;
    printf("blocking recv, SA_RESTART, SO_RCVTIMEO 2 s: %s alarms=%d before_timeout=%d\n", r, alarms - a0, waited < 1.5);

    /* poll is never restarted, SA_RESTART or not; ppoll's mask holds the signal off until it
     * returns (timed out). */
    a0 = alarms;
    ualarm(100000, 0);
    int pr = poll(&(struct pollfd){.fd = s, .events = POLLIN}, 1, 2000);
    printf("poll, SA_RESTART, interrupted: %s alarms=%d\n", res(pr), alarms - a0);
    sigset_t held;
    sigemptyset(&held);
    sigaddset(&held, SIGALRM);
    a0 = alarms;
    ualarm(100000, 0);
    struct timespec ts = {0, 300000000};
    pr = ppoll(&(struct pollfd){.fd = s, .events = POLLIN}, 1, &ts, &held);
    printf("ppoll, SIGALRM held by its mask: %s alarms=%d\n", res(pr), alarms - a0);
    int ep = epoll_create1(0);
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &(struct epoll_event){.events = EPOLLIN});
    struct epoll_event got;
    a0 = alarms;
    ualarm(100000, 0);
    pr = epoll_wait(ep, &got, 1, 2000);
    printf("epoll_wait, SA_RESTART, interrupted: %s alarms=%d\n", res(pr), alarms - a0);
    a0 = alarms;
    ualarm(100000, 0);
    pr = epoll_pwait(ep, &got, 1, 300, &held);
    printf("epoll_pwait, SIGALRM held by its mask: %s alarms=%d\n", res(pr), alarms - a0);
    /* A signal pending while blocked, which only the call's mask lets in: EINTR at once. */
    sigset_t old, open;
    sigprocmask(SIG_BLOCK, &held, &old);
    sigemptyset(&open);
    a0 = alarms;
    raise(SIGALRM);
    pr = epoll_pwait(ep, &got, 1, 2000, &open);
    printf("epoll_pwait, pending signal its mask lets in: %s alarms=%d\n", res(pr), alarms - a0);
    a0 = alarms;
    raise(SIGALRM);
    ts = (struct timespec){2, 0};
    pr = ppoll(&(struct pollfd){.fd = s, .events = POLLIN}, 1, &ts, &open);
    printf("ppoll, pending signal its mask lets in: %s alarms=%d\n", res(pr), alarms - a0);
    sigprocmask(SIG_SETMASK, &old, NULL);
    close(ep);
    sigaction(SIGALRM, &plain, NULL);
    close(s);
}

static void *blocked_recv(void *arg) {
    char b[64];
    return (void *)(long)recv((int)(long)arg, b, sizeof b, 0);
}

/* shutdown(SHUT_RD): buffered data is still read, then 0; poll shows POLLIN|POLLRDHUP; a
 * thread blocked in recv is woken with 0. O_NONBLOCK belongs to the open file description. */
static void shut_rd_and_flags(const char *host, int port) {
    int s = dial(host, port, 0);
    char b[64];
    cmd(s, "d");
    wait_bytes(s, 10);
    printf("shutdown(SHUT_RD) with 10 buffered: %s", res(shutdown(s, SHUT_RD)));
    printf(" poll=%#x epoll=%#x", wait_revents(s, POLLIN), epoll_mask(s));
    printf(" read=%s", res(read(s, b, sizeof b)));
    printf(" read=%s", res(read(s, b, sizeof b)));
    printf(" poll=%#x\n", wait_revents(s, POLLIN));
    close(s);

    s = dial(host, port, 0);
    pthread_t t;
    pthread_create(&t, NULL, blocked_recv, (void *)(long)s);
    usleep(200000);
    shutdown(s, SHUT_RD);
    void *ret;
    pthread_join(t, &ret);
    printf("recv blocked in another thread, shutdown(SHUT_RD): %ld\n", (long)ret);
    close(s);

    s = dial(host, port, 0);
    int d = dup(s);
    fcntl(s, F_SETFL, fcntl(s, F_GETFL) | O_NONBLOCK);
    int seen = !!(fcntl(d, F_GETFL) & O_NONBLOCK);
    printf("O_NONBLOCK set on one fd, seen on its dup: %d read on the dup=%s", seen, res(read(d, b, sizeof b)));
    fcntl(d, F_SETFL, fcntl(d, F_GETFL) & ~O_NONBLOCK);
    printf(" cleared on the dup, seen on the original: %d\n", !(fcntl(s, F_GETFL) & O_NONBLOCK));
    close(d); close(s);
}

static volatile sig_atomic_t urgent_signals;
static void on_urg(int sig) { (void)sig; urgent_signals++; }

/* poll's POLLPRI within 2 s. */
static int wait_pri(int s) {
    struct pollfd p = {.fd = s, .events = POLLPRI};
    for (int i = 0; i < 200; i++) {
        p.revents = 0;
        if (poll(&p, 1, 0) == 1 && (p.revents & POLLPRI)) return 1;
        usleep(10000);
    }
    return 0;
}

/* Urgent data (MSG_OOB), out of band and inline: SIGURG to the owner, POLLPRI and select's
 * exceptional condition, reads that stop at the mark (MSG_WAITALL too), SIOCATMARK, the byte
 * read out of band once (then EINVAL), and an urgent byte the reader goes past without taking
 * it. */
static void urgent_data(const char *host, int port) {
    struct sigaction sa = {.sa_handler = on_urg, .sa_flags = SA_RESTART};
    sigaction(SIGURG, &sa, NULL);
    for (int in_line = 0; in_line < 2; in_line++) {
        int s = dial(host, port, 0), mark = -1;
        if (s < 0) { errno = -s; die("connect"); }
        fcntl(s, F_SETOWN, getpid());
        setsockopt(s, SOL_SOCKET, SO_OOBINLINE, &in_line, sizeof in_line);
        int opt = -1; socklen_t ol = sizeof opt;
        getsockopt(s, SOL_SOCKET, SO_OOBINLINE, &opt, &ol);
        urgent_signals = 0;
        char b[64] = {0}, o = 0;
        cmd(s, "U");
        int pri = wait_pri(s);
        /* The bytes after the urgent one (inline, all 7 count; out of band, those before it). */
        if (in_line) wait_bytes(s, 7);
        usleep(200000);
        fd_set x; FD_ZERO(&x); FD_SET(s, &x);
        struct timeval tv = {0, 0};
        int ex = select(s + 1, NULL, NULL, &x, &tv);
        int inq = -1;
        ioctl(s, FIONREAD, &inq);
        printf("urgent (SO_OOBINLINE %d): SIGURG %d POLLPRI %d select except %d FIONREAD %d", opt, urgent_signals > 0, pri, ex, inq);
        ioctl(s, SIOCATMARK, &mark);
        printf(" atmark %d", mark);
        /* Stops at the mark with bytes read, MSG_WAITALL or not. */
        ssize_t r = recv(s, b, 6, MSG_WAITALL);
        ioctl(s, SIOCATMARK, &mark);
        printf(" read (MSG_WAITALL 6) %s %.*s atmark %d", res(r), (int)(r > 0 ? r : 0), b, mark);
        ioctl(s, FIONREAD, &inq);
        printf(" FIONREAD %d", inq);
        struct iovec ov = {.iov_base = &o, .iov_len = 1};
        struct msghdr om = {.msg_iov = &ov, .msg_iovlen = 1};
        r = recvmsg(s, &om, MSG_OOB | MSG_PEEK);
        printf(" oob peek (recvmsg) %s %c flags %#x", res(r), r == 1 ? o : '-', r == 1 ? om.msg_flags : 0);
        r = recv(s, &o, 1, MSG_OOB);
        printf(" oob %s %c", res(r), r == 1 ? o : '-');
        printf(" again %s", res(recv(s, &o, 1, MSG_OOB)));
        r = recv(s, b, sizeof b, 0);
        ioctl(s, SIOCATMARK, &mark);
        struct pollfd p = {.fd = s, .events = POLLPRI};
        poll(&p, 1, 0);
        printf(" read %s %.*s atmark %d POLLPRI %d\n", res(r), (int)(r > 0 ? r : 0), b, mark, !!(p.revents & POLLPRI));
        /* The urgent byte last, never taken out of band: the read stops before it, and a read
         * at the mark goes past it (kept out of the stream: nothing to read). */
        cmd(s, "V");
        wait_pri(s);
        usleep(100000);
        r = recv(s, b, sizeof b, 0);
        ioctl(s, SIOCATMARK, &mark);
        printf("urgent byte last (SO_OOBINLINE %d): read %s %.*s atmark %d", in_line, res(r), (int)(r > 0 ? r : 0), b, mark);
        r = recv(s, b, sizeof b, MSG_DONTWAIT);
        printf(" read %s %.*s", res(r), (int)(r > 0 ? r : 0), b);
        printf(" oob %s\n", res(recv(s, &o, 1, MSG_OOB)));
        close(s);
    }
    signal(SIGURG, SIG_DFL);
}

#define ZLEN 100000

static void pattern(char *b, int n, int seed) {
    for (int i = 0; i < n; i++) b[i] = (char)(i * 7 + i / 251 + seed);
}

struct sink { int s, spl; char *buf; int got; };

/* Reads the echo to EOF, with read or by splice through a pipe. */
static void *sink(void *arg) {
    struct sink *k = arg;
    int pp[2];
    if (k->spl) pipe(pp);
    for (;;) {
        ssize_t r;
        if (k->spl) {
            r = splice(k->s, NULL, pp[1], NULL, 65536, 0);
            if (r > 0) for (ssize_t o = 0; o < r;) { ssize_t q = read(pp[0], k->buf + k->got, r - o); if (q <= 0) break; o += q; k->got += q; }
        } else {
            r = read(k->s, k->buf + k->got, ZLEN - k->got);
            if (r > 0) k->got += r;
        }
        if (r <= 0 || k->got >= ZLEN) break;
    }
    if (k->spl) { close(pp[0]); close(pp[1]); }
    return NULL;
}

/* sendfile file -> socket; splice pipe -> socket and socket -> pipe; writev/readv of IOV_MAX
 * iovecs (one more is EINVAL). Content echoed by the server and compared. */
static void zero_copy_and_vectors(const char *host, int port) {
    static char want[ZLEN], got[ZLEN];
    pattern(want, ZLEN, 1);
    char path[] = "/tmp/conform-sendfile-XXXXXX";
    int f = mkstemp(path);
    unlink(path);
    write(f, want, ZLEN);
    int s = dial(host, port, 0);
    cmd(s, "E");
    struct sink k = {.s = s, .buf = got};
    pthread_t t;
    pthread_create(&t, NULL, sink, &k);
    off_t off = 0;
    long sent = 0;
    while (sent < ZLEN) { ssize_t r = sendfile(s, f, &off, ZLEN - sent); if (r <= 0) break; sent += r; }
    shutdown(s, SHUT_WR);
    pthread_join(t, NULL);
    printf("sendfile: sent=%ld echoed=%d equal=%d\n", sent, k.got, !memcmp(want, got, ZLEN));
    close(s); close(f);

    pattern(want, ZLEN, 2);
    memset(got, 0, ZLEN);
    s = dial(host, port, 0);
    cmd(s, "E");
    k = (struct sink){.s = s, .spl = 1, .buf = got};
    pthread_create(&t, NULL, sink, &k);
    int pp[2];
    pipe(pp);
    long moved = 0;
    for (int o = 0; o < ZLEN; o += 4096) {
        int n = ZLEN - o < 4096 ? ZLEN - o : 4096;
        write(pp[1], want + o, n);
        for (int m = 0; m < n;) { ssize_t r = splice(pp[0], NULL, s, NULL, n - m, 0); if (r <= 0) break; m += r; moved += r; }
    }
    shutdown(s, SHUT_WR);
    pthread_join(t, NULL);
    printf("splice pipe->socket: %ld socket->pipe: %d equal=%d\n", moved, k.got, !memcmp(want, got, ZLEN));
    close(pp[0]); close(pp[1]); close(s);

    /* IOV_MAX iovecs of 8 bytes each. */
    static struct iovec iov[IOV_MAX + 1];
    for (int i = 0; i <= IOV_MAX; i++) iov[i] = (struct iovec){want + i * 8, 8};
    s = dial(host, port, 0);
    cmd(s, "E");
    printf("writev %d iovecs: %s", IOV_MAX + 1, res(writev(s, iov, IOV_MAX + 1)));
    struct msghdr too_many = {.msg_iov = iov, .msg_iovlen = IOV_MAX + 1};
    printf(" sendmsg: %s", res(sendmsg(s, &too_many, MSG_NOSIGNAL)));
    printf(" %d iovecs: %s", IOV_MAX, res(writev(s, iov, IOV_MAX)));
    memset(got, 0, ZLEN);
    for (int i = 0; i < IOV_MAX; i++) iov[i] = (struct iovec){got + i * 8, 8};
    int total = 0, ok = 1;
    while (total < IOV_MAX * 8) {
        /* Resume in the iovec where the last readv stopped. */
        int i = total / 8;
        struct iovec v[IOV_MAX];
        memcpy(v, iov + i, (IOV_MAX - i) * sizeof *v);
        v[0].iov_base = got + total; v[0].iov_len = 8 - total % 8;
        ssize_t r = readv(s, v, IOV_MAX - i);
        if (r <= 0) { ok = 0; break; }
        total += r;
    }
    printf(" readv %d iovecs: %d equal=%d\n", IOV_MAX, ok ? total : -1, !memcmp(want, got, IOV_MAX * 8));
    close(s);
}

/* One round with the forking server (PORT+2): two connections, each served by a child forked
 * for it (the parent closed its copy at once), echo once and end, the first while the second
 * is still open; the round as a line. */
static void forkserver_round(const char *host, int port, char *line, size_t len) {
    char b[64], e1[8], e2[8];
    int c1 = dial(host, port + 2, 0), c2 = dial(host, port + 2, 0);
    cmd(c1, "eone1");
    cmd(c2, "etwo2");
    int n1 = read_full(c1, e1, 4), n2 = read_full(c2, e2, 4);
    /* The first child's end of stream comes while the second child still serves. */
    cmd(c1, "x");
    const char *eof1 = res(read(c1, b, sizeof b));
    cmd(c2, "x");
    const char *eof2 = res(read(c2, b, sizeof b));
    snprintf(line, len, "forkserver: echo %.*s %.*s eof %s %s\n", n1, e1, n2, e2, eof1, eof2);
    close(c1); close(c2);
}

/* One connection lent to a program started by posix_spawn with it as stdin and stdout, which
 * echoes once through it and exits; then the parent, which kept its copy, goes on with it. */
static void spawn_round(const char *host, int port, const char *self, char *line, size_t len) {
    char b[8];
    int s = dial(host, port, 0), st = -1;
    pid_t pid;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, s, 0);
    posix_spawn_file_actions_adddup2(&fa, s, 1);
    char *argv[] = {"conform", "spawn-child", NULL};
    int sr = posix_spawn(&pid, self, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (sr == 0) waitpid(pid, &st, 0);
    cmd(s, "eafta");
    int n = read_full(s, b, 4);
    snprintf(line, len, "posix_spawn child echoing through stdin/stdout: spawn=%d exit=%d\n"
             "  parent after the spawned child: %.*s%s\n", sr, WIFEXITED(st) ? WEXITSTATUS(st) : -1, n, b,
             why_short(n, 4));
    close(s);
}

/* One connection used by a forked child, which echoes once and exits; then the parent, which
 * left its copy alone meanwhile, goes on with it. */
static void child_round(const char *host, int port, char *line, size_t len) {
    char b[8];
    int s = dial(host, port, 0), st = -1;
    pid_t pid = fork();
    if (pid == 0) {
        cmd(s, "echld");
        _exit(read_full(s, b, 4) == 4 && !memcmp(b, "chld", 4) ? 0 : 1);
    }
    waitpid(pid, &st, 0);
    cmd(s, "eprnt");
    int n = read_full(s, b, 4);
    snprintf(line, len, "forked child echoing: exit=%d\n  parent after the child exited: %.*s%s\n",
             WIFEXITED(st) ? WEXITSTATUS(st) : -1, n, b, why_short(n, 4));
    close(s);
}

/* One connection passed by SCM_RIGHTS to an exec'd child, our copy closed at once: the child
 * echoes through it and sees its end. */
static void scm_round(const char *host, int port, const char *self, char *line, size_t len) {
    int s = dial(host, port, 0);
    char *argv[] = {(char *)self, "scm-recv", NULL};
    quiet_receiver = 1;
    snprintf(line, len, "SCM_RIGHTS to an exec'd child, sender closed its copy: exit=%d\n", pass_fd(s, argv));
    quiet_receiver = 0;
}

/* N rounds of `forkserver_round` ("fork"), `spawn_round` ("spawn"), `child_round` ("child")
 * or `scm_round` ("scm"): each fork may find the other threads of the process anywhere,
 * holding or waiting for any lock, and each round's timing differs. */
static void rounds(const char *kind, const char *host, int port, int n, const char *self) {
    char line[256], first[256] = "", other[256] = "";
    int same = 0, at = -1;
    signal(SIGPIPE, SIG_IGN); /* a failed write shows in the round's line */
    for (int i = 0; i < n; i++) {
        if (!strcmp(kind, "fork")) forkserver_round(host, port, line, sizeof line);
        else if (!strcmp(kind, "child")) child_round(host, port, line, sizeof line);
        else if (!strcmp(kind, "scm")) scm_round(host, port, self, line, sizeof line);
        else spawn_round(host, port, self, line, sizeof line);
        if (i == 0) strcpy(first, line);
        if (strcmp(line, first) && at < 0) { at = i; strcpy(other, line); }
        same += !strcmp(line, first);
    }
    printf("%srounds %d, all alike=%d\n", first, n, same == n);
    if (at >= 0) printf("round %d was:\n%s", at, other);
}

/* Processes: a forked child uses the inherited socket while the parent leaves it alone, then
 * the parent goes on; a per-connection forking server; posix_spawn with the socket as stdin
 * and stdout; SCM_RIGHTS to an exec'd process, the sender closing its copy. */
static void processes(const char *host, int port, const char *self) {
    int s = dial(host, port, 0);
    char b[64];
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        cmd(s, "echld");
        printf("forked child echo: %.*s\n", read_full(s, b, 4), b);
        exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    cmd(s, "eprnt");
    printf("parent after the child exited: %.*s\n", read_full(s, b, 4), b);
    close(s);

    char line[256];
    forkserver_round(host, port, line, sizeof line);
    printf("%s", line);

    fflush(stdout);
    spawn_round(host, port, self, line, sizeof line);
    printf("%s", line);

    /* A forked child that holds copies of every fd and touches none (a worker, a BGSAVE):
     * the parent still sees the peer's reset and end of stream at once. */
    int rs = dial(host, port, 0), fs = dial(host, port, 0);
    fflush(stdout);
    pid_t idle = fork();
    if (idle == 0) { sleep(5); _exit(0); }
    cmd(rs, "r");
    cmd(fs, "x");
    /* POLLHUP, which TCP shows a moment after POLLERR (tcp_reset: the error, then the state). */
    int rv = wait_revents(rs, POLLHUP);
    printf("beside an idle child: after RST poll=%#x epoll=%#x so_error=%s;", rv, epoll_mask(rs), en(so_error(rs)));
    rv = wait_revents(fs, POLLRDHUP);
    printf(" after FIN poll=%#x epoll=%#x\n", rv, epoll_mask(fs));
    kill(idle, SIGKILL);
    waitpid(idle, &st, 0);
    close(rs); close(fs);

    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    char *wargv[] = {"conform", "exit-writer", (char *)host, portstr, NULL};
    int exits[5];
    for (int i = 0; i < 5; i++) {
        st = -1;
        if (posix_spawn(&pid, self, NULL, NULL, wargv, environ) == 0) waitpid(pid, &st, 0);
        exits[i] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    printf("exit while another thread writes: %d %d %d %d %d\n", exits[0], exits[1], exits[2], exits[3], exits[4]);
}

/* A process whose main thread exits while another thread writes to a connection: the exit
 * ends the writer (exit_group), which never sees the connection shut by the exit (the library
 * once had it fail with EPIPE, and SIGPIPE killed the process: status 141). */
static int exit_writer_fd;
static void *exit_writer_loop(void *arg) {
    (void)arg;
    char b[1000];
    memset(b, 'z', sizeof b);
    for (;;)
        if (write(exit_writer_fd, b, sizeof b) < 0) _exit(7);
    return NULL;
}
static int exit_writer(const char *host, int port) {
    exit_writer_fd = dial(host, port, 0);
    cmd(exit_writer_fd, "w");
    pthread_t t;
    pthread_create(&t, NULL, exit_writer_loop, NULL);
    usleep(200000);
    exit(0);
}

/* Passes `s` over a unix socketpair to `argv` (exec'd in a child), closes our copy, and waits. */
static int pass_fd(int s, char *const argv[]) {
    int sp[2];
    socketpair(AF_UNIX, SOCK_STREAM, 0, sp);
    char fd[16];
    snprintf(fd, sizeof fd, "%d", sp[1]);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(sp[0]);
        if (quiet_receiver) { int null = open("/dev/null", O_WRONLY); dup2(null, 1); close(null); }
        char *a[8];
        int i = 0;
        for (; argv[i]; i++) a[i] = argv[i];
        a[i++] = fd;
        a[i] = NULL;
        execv(a[0], a);
        _exit(127);
    }
    close(sp[1]);
    char c[CMSG_SPACE(sizeof(int))] = {0};
    struct iovec v = {"s", 1};
    struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = c, .msg_controllen = sizeof c};
    struct cmsghdr *h = CMSG_FIRSTHDR(&m);
    h->cmsg_level = SOL_SOCKET;
    h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(h), &s, sizeof s);
    sendmsg(sp[0], &m, 0);
    close(s);
    write(sp[0], "g", 1); /* go: our copy is closed */
    int st = -1;
    waitpid(pid, &st, 0);
    close(sp[0]);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void scm_rights(const char *host, int port, const char *self) {
    int s = dial(host, port, 0);
    char *argv[] = {(char *)self, "scm-recv", NULL};
    int st = pass_fd(s, argv);
    printf("SCM_RIGHTS to an exec'd child, sender closed its copy: exit=%d\n", st);
}

/* The same, to a process started with `env -u LD_PRELOAD` (without the library). On kernel
 * TCP it works like any other; `netchannel run` documents what it does. */
static void scm_nolib(const char *host, int port) {
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = 0;
    int s = dial(host, port, 0);
    if (s < 0) { errno = -s; die("connect"); }
    char *argv[] = {"/usr/bin/env", "-u", "LD_PRELOAD", exe, "scm-recv", NULL};
    int st = pass_fd(s, argv);
    printf("SCM_RIGHTS to a process without the library: exit=%d\n", st);
}

/* Receiver: takes the socket, waits for the sender's go, echoes through it, sees EOF. */
static int scm_recv(int u) {
    char c[CMSG_SPACE(sizeof(int))], one, b[64];
    struct iovec v = {&one, 1};
    struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = c, .msg_controllen = sizeof c};
    if (recvmsg(u, &m, 0) != 1) die("recvmsg");
    struct cmsghdr *h = CMSG_FIRSTHDR(&m);
    if (!h || h->cmsg_type != SCM_RIGHTS) die("SCM_RIGHTS");
    int s;
    memcpy(&s, CMSG_DATA(h), sizeof s);
    read(u, &one, 1);
    cmd(s, "erecv");
    int n = read_full(s, b, 4);
    printf("  receiver: echo %.*s", n, b);
    cmd(s, "x");
    printf(" eof %s\n", res(read(s, b, sizeof b)));
    return n == 4 && !memcmp(b, "recv", 4) ? 0 : 1;
}

/* posix_spawn'd with the socket as stdin and stdout. */
static int spawn_child(void) {
    char b[4];
    write(1, "espwn", 5);
    return read_full(0, b, 4) == 4 && !memcmp(b, "spwn", 4) ? 0 : 1;
}

static void client(const char *host, int port) {
    signal(SIGPIPE, SIG_IGN);
    /* Non-blocking connect, SO_ERROR. */
    int s = dial(host, port, 1);
    if (s < 0) { errno = -s; die("connect"); }
    struct pollfd p = {.fd = s, .events = POLLOUT};
    poll(&p, 1, 5000);
    int err = -1; socklen_t el = sizeof err;
    getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &el);
    printf("nonblocking connect: writable=%d so_error=%d\n", !!(p.revents & POLLOUT), err);
    struct sockaddr_in pa; socklen_t pl = sizeof pa;
    getpeername(s, (void *)&pa, &pl);
    printf("getpeername port matches: %d\n", ntohs(pa.sin_port) == port);
    int fl = 1; ioctl(s, FIONBIO, &fl);

    /* Level-triggered, edge-triggered and one-shot epoll on 10 unread bytes. */
    write(s, "d", 1);
    poll(&(struct pollfd){.fd = s, .events = POLLIN}, 1, 5000);
    usleep(50000);
    int n = -1; ioctl(s, FIONREAD, &n);
    printf("FIONREAD: %d\n", n);
    char b[64];
    printf("MSG_PEEK: %zd\n", recv(s, b, 4, MSG_PEEK));
    int modes[3] = {0, EPOLLET, EPOLLONESHOT};
    const char *names[3] = {"LT", "ET", "ONESHOT"};
    for (int i = 0; i < 3; i++) {
        int ep = epoll_create1(0);
        struct epoll_event ev = {.events = EPOLLIN | modes[i], .data.fd = s};
        epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
        int a1 = wait_ev(ep, 1000), a2 = wait_ev(ep, 100);
        /* Nested: an epoll fd holding `ep` is readable while `ep` has events. */
        int outer = epoll_create1(0);
        struct epoll_event oe = {.events = EPOLLIN, .data.fd = ep};
        epoll_ctl(outer, EPOLL_CTL_ADD, ep, &oe);
        int nested = wait_ev(outer, 100);
        printf("epoll %s: first=%d second=%d nested=%d\n", names[i], a1, a2, nested);
        close(outer); close(ep);
    }
    printf("read: %zd\n", read(s, b, sizeof b));
    ssize_t r0 = read(s, b, sizeof b);
    printf("read empty: %zd errno=%s\n", r0, errno == EAGAIN ? "EAGAIN" : "other");

    /* select with the socket at fd 1000. */
    write(s, "d", 1);
    if (dup2(s, 1000) != 1000) die("dup2");
    fd_set rs; FD_ZERO(&rs); FD_SET(1000, &rs);
    struct timeval tv = {5, 0};
    printf("select fd 1000: %d isset=%d\n", select(1001, &rs, NULL, NULL, &tv), FD_ISSET(1000, &rs));
    usleep(50000);
    printf("read via fd 1000: %zd\n", read(1000, b, sizeof b));
    close(1000);

    /* fork, child closes its copy: the parent's connection goes on. */
    pid_t pid = fork();
    if (pid == 0) { close(s); _exit(0); }
    waitpid(pid, NULL, 0);
    fl = 0; ioctl(s, FIONBIO, &fl);
    write(s, "eabcd", 5);
    int got = 0; while (got < 4) { ssize_t r = read(s, b + got, 4 - got); if (r <= 0) break; got += r; }
    printf("echo after fork-close: %.*s\n", got, b);

    /* Shut down by the peer: EOF, EPOLLRDHUP. */
    write(s, "s", 1);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.fd = s}, out;
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    epoll_wait(ep, &out, 1, 5000);
    printf("rdhup: %d\n", !!(out.events & EPOLLRDHUP));
    printf("read at eof: %zd\n", read(s, b, sizeof b));
    close(ep); close(s);

    /* Partial writes: a peer that reads nothing fills the buffers, then EAGAIN. */
    s = dial(host, port, 0);
    write(s, "h", 1);
    fl = 1; ioctl(s, FIONBIO, &fl);
    static char big[1 << 16];
    long total = 0; ssize_t w;
    while ((w = send(s, big, sizeof big, MSG_NOSIGNAL)) > 0) total += w;
    printf("fill: some=%d then EAGAIN=%d\n", total > 0, errno == EAGAIN);
    close(s);

    /* Refused connect (nothing listens on port+1). */
    s = dial(host, port + 1, 1);
    if (s >= 0) {
        struct pollfd q = {.fd = s, .events = POLLOUT};
        poll(&q, 1, 5000);
        el = sizeof err; getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &el);
        printf("refused: so_error=%s\n", err == ECONNREFUSED ? "ECONNREFUSED" : strerror(err));
        close(s);
    } else printf("refused: so_error=%s\n", -s == ECONNREFUSED ? "ECONNREFUSED" : strerror(-s));

    /* UDP and DNS pass through. */
    int u1 = socket(AF_INET, SOCK_DGRAM, 0), u2 = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in ua = {.sin_family = AF_INET}; inet_pton(AF_INET, "127.0.0.1", &ua.sin_addr);
    bind(u1, (void *)&ua, sizeof ua); socklen_t ul = sizeof ua; getsockname(u1, (void *)&ua, &ul);
    sendto(u2, "udp", 3, 0, (void *)&ua, sizeof ua);
    printf("udp: %zd\n", recv(u1, b, sizeof b, 0));
    struct addrinfo *ai = NULL;
    printf("getaddrinfo localhost: %d\n", getaddrinfo("localhost", NULL, NULL, &ai) == 0);

    more(host, port, "/proc/self/exe");
    epoll_cases(host, port);
    mixed_sets(host, port);
    low_water(host, port);
    null_buffer(host, port);
    wait_timeouts(host, port);
    fin_and_reset(host, port);
    timeouts_and_signals(host, port);
    shut_rd_and_flags(host, port);
    urgent_data(host, port);
    full_window(host, port);
    linger_close(host, port);
    zero_copy_and_vectors(host, port);
    raw_syscalls(host, port);
    connect_in_progress(host, port);
    processes(host, port, "/proc/self/exe");
    scm_rights(host, port, "/proc/self/exe");

    s = dial(host, port, 0);
    write(s, "q", 1);
    close(s);
}

/* A close no library can see (the system call instruction itself, as statically linked
 * runtimes make it; through syscall() elsewhere). */
static long unseen_close(int fd) {
#if defined(__x86_64__)
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"((long)SYS_close), "D"((long)fd) : "rcx", "r11", "memory");
    if (r < 0) { errno = (int)-r; return -1; }
    return r;
#else
    return syscall(SYS_close, fd);
#endif
}

static int by_closefrom(int fd) { closefrom(fd); return 0; }
static int by_close_range(int fd) { return close_range(fd, ~0U, 0); }

/* A range the program closes (closefrom: glibc makes its own close_range call; close_range to
 * the last number, as Python's os.closerange): the connection in it is closed and its peer
 * reads its end of stream; the process's later connections go on (the library's own fds are
 * not the program's to close). */
static void range_close(const char *host, int port, const char *name, int (*closer)(int)) {
    int w = dial(host, port, 0), k = dial(host, port, 0);
    if (w < 0 || k < 0) { errno = w < 0 ? -w : -k; die("connect"); }
    write(w, "Wbytes", 6);
    int hi = fcntl(w, F_DUPFD, 900);
    close(w);
    int rc = closer(hi);
    int gone = fcntl(hi, F_GETFD) < 0 && errno == EBADF;
    write(k, "K", 1);
    char seen[4] = {0}, echo[4];
    int got = read_full(k, seen, 3);
    close(k);
    int n = dial(host, port, 0);
    if (n < 0) { errno = -n; die("connect"); }
    write(n, "eNEXT", 5);
    int next = read_full(n, echo, 4);
    printf("%s: %d, number closed %d, peer read end of stream: %.*s, next connection echo %.*s\n",
           name, rc, gone, got, seen, next, echo);
    close(n);
}

/* Socket calls made through libc's syscall() instead of the named wrappers (libuv closes every
 * fd so): they behave as the named calls, and a connection closed that way is gone, so the next
 * socket under its number is a new one. A close made without libc at all is noticed when the
 * kernel hands the number out again (here to an epoll set, which has no socket name). */
static void raw_syscalls(const char *host, int port) {
    int s = dial(host, port, 0);
    if (s < 0) { errno = -s; die("connect"); }
    char b[16];
    long w = syscall(SYS_write, s, "e", 1);
    w += syscall(SYS_sendto, s, "abcd", 4, 0, NULL, 0);
    int n = 0;
    while (n < 4) { long r = syscall(SYS_read, s, b + n, 4 - n); if (r <= 0) break; n += r; }
    printf("raw write, sendto, read: %ld %d %.*s\n", w, n, n, b);
    int ep = (int)syscall(SYS_epoll_create1, 0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = s}, out[2];
    long ctl = syscall(SYS_epoll_ctl, ep, EPOLL_CTL_ADD, s, &ev);
    write(s, "d", 1);
    long k = syscall(SYS_epoll_pwait, ep, out, 2, 5000, NULL, 8);
    long r = syscall(SYS_recvfrom, s, b, 10, MSG_WAITALL, NULL, NULL);
    printf("raw epoll: ctl %ld events %ld fd %d recvfrom %ld\n", ctl, k, k == 1 && out[0].data.fd == s, r);
    int fl = (int)syscall(SYS_fcntl, s, F_GETFL);
    printf("raw fcntl: nonblocking %d\n", !!(fl & O_NONBLOCK));
    long cl = syscall(SYS_close, s);
    int t = dial(host, port, 0);
    if (t < 0) { errno = -t; die("connect"); }
    write(t, "eWXYZ", 5);
    printf("raw close: %ld, next socket same number %d, echo %d\n", cl, t == s, read_full(t, b, 4));
    close(t);
    printf("after close, epoll set empty: %d\n", wait_ev(ep, 50));
    close(ep);
    int u = dial(host, port, 0);
    if (u < 0) { errno = -u; die("connect"); }
    long uc = unseen_close(u);
    int e = epoll_create1(0);
    struct sockaddr_in sa; socklen_t sl = sizeof sa;
    int gs = getsockname(e, (void *)&sa, &sl) < 0 ? errno : 0;
    printf("unseen close: %ld, epoll set under the number %d, its getsockname %s\n", uc, e == u,
           gs == ENOTSOCK ? "ENOTSOCK" : en(gs));
    close(e);
    range_close(host, port, "closefrom", by_closefrom);
    range_close(host, port, "close_range to the end", by_close_range);
}

/* Non-blocking connects to a listener that does not accept (backlog 1): each returns
 * EINPROGRESS at once; the last, beyond the backlog (TCP queues 2; the library at most twice
 * that), stays unwritable, without a peer and EALREADY to a second connect; once the server
 * accepts, every one becomes writable with SO_ERROR 0, a second connect returns 0 then EISCONN,
 * and bytes go both ways. */
#define HELD 6
static void connect_in_progress(const char *host, int port) {
    int ctl = dial(host, port, 0);
    if (ctl < 0) { errno = -ctl; die("connect"); }
    /* A first connection, accepted and closed: the destination is known to carry. */
    int s[HELD];
    s[0] = dial(host, port + 3, 0);
    if (s[0] < 0) { errno = -s[0]; die("connect held"); }
    write(ctl, "A1", 2);
    write(s[0], "x", 1);
    char b[16];
    printf("in progress: first held connection ends: %zd\n", read(s[0], b, 1));
    close(s[0]);
    int in_progress = 0, slow = 0;
    for (int i = 0; i < HELD; i++) {
        s[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port + 3)};
        inet_pton(AF_INET, host, &a.sin_addr);
        double t0 = now(CLOCK_MONOTONIC);
        int rc = connect(s[i], (void *)&a, sizeof a);
        slow += now(CLOCK_MONOTONIC) - t0 > 0.5;
        in_progress += rc < 0 && errno == EINPROGRESS;
        if (rc < 0 && errno != EINPROGRESS) die("connect in progress");
    }
    printf("in progress: %d connects returned EINPROGRESS, %d took over 0.5 s\n", in_progress, slow);
    /* The last one is beyond the backlog: still connecting. */
    int last = s[HELD - 1];
    struct pollfd p = {.fd = last, .events = POLLOUT};
    int ready = poll(&p, 1, 300);
    struct sockaddr_in pa; socklen_t pl = sizeof pa;
    int gp = getpeername(last, (void *)&pa, &pl) < 0 ? errno : 0;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port + 3)};
    inet_pton(AF_INET, host, &a.sin_addr);
    int again = connect(last, (void *)&a, sizeof a) < 0 ? errno : 0;
    printf("in progress: beyond the backlog: poll %d, getpeername %s, connect again %s\n",
           ready, en(gp), en(again));
    /* A blocking connect beyond the backlog gives up waiting after its send timeout, as TCP's
     * does: EINPROGRESS (the open goes on; closed here). */
    int blocking = socket(AF_INET, SOCK_STREAM, 0);
    struct timeval tv = {.tv_sec = 0, .tv_usec = 300000};
    setsockopt(blocking, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    double t0 = now(CLOCK_MONOTONIC);
    int brc = connect(blocking, (void *)&a, sizeof a) < 0 ? errno : 0;
    double waited = now(CLOCK_MONOTONIC) - t0;
    printf("in progress: a blocking connect with SO_SNDTIMEO 0.3 s: %s, after 0.25-1 s: %s\n",
           en(brc), waited >= 0.25 && waited < 1 ? "yes" : "no");
    /* Again, still beyond the backlog: it waits its timeout again (no spinning retry loop). */
    t0 = now(CLOCK_MONOTONIC);
    brc = connect(blocking, (void *)&a, sizeof a) < 0 ? errno : 0;
    waited = now(CLOCK_MONOTONIC) - t0;
    printf("in progress: connect again: %s, after 0.25-1 s: %s\n", en(brc),
           waited >= 0.25 && waited < 1 ? "yes" : "no");
    close(blocking);
    /* shutdown gives a connect in progress up: 0, then the socket fails (ECONNRESET). */
    int given_up = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (connect(given_up, (void *)&a, sizeof a) == 0 || errno != EINPROGRESS) die("connect");
    int src = shutdown(given_up, SHUT_RDWR) < 0 ? errno : 0;
    struct pollfd gp_ = {.fd = given_up, .events = POLLOUT};
    poll(&gp_, 1, 1000);
    printf("in progress: shutdown %s, then POLLERR %d POLLHUP %d, SO_ERROR %s\n", en(src),
           !!(gp_.revents & POLLERR), !!(gp_.revents & POLLHUP), en(so_error(given_up)));
    {
        char gb[8];
        /* POLLIN|POLLRDHUP left out: the placeholder cannot show POLLHUP without them. */
        int gv = wait_revents(given_up, POLLHUP) & (POLLOUT | POLLHUP | POLLERR);
        printf("  then poll(out,hup,err)=%#x recv=%s", gv, res(recv(given_up, gb, sizeof gb, 0)));
        printf(" send=%s\n", res(send(given_up, "x", 1, MSG_NOSIGNAL)));
    }
    close(given_up);
    write(ctl, "A6", 2);
    int ok = 0;
    for (int i = 0; i < HELD; i++) {
        struct pollfd q = {.fd = s[i], .events = POLLOUT};
        int w = poll(&q, 1, 10000);
        if (w == 1 && so_error(s[i]) == 0) ok++;
    }
    int c1 = connect(last, (void *)&a, sizeof a) < 0 ? errno : 0;
    int c2 = connect(last, (void *)&a, sizeof a) < 0 ? errno : 0;
    printf("in progress: %d writable with SO_ERROR 0; connect again %s then %s\n", ok, en(c1), en(c2));
    int echoed = 0;
    for (int i = 0; i < HELD; i++) {
        int fl = 0; ioctl(s[i], FIONBIO, &fl);
        write(s[i], "eabcd", 5);
        echoed += read_full(s[i], b, 4) == 4 && !memcmp(b, "abcd", 4);
        close(s[i]);
    }
    printf("in progress: %d echoed\n", echoed);
    close(ctl);
}

/* Another thread's own event loop over its own connection (for `elide`). */
struct own_loop { const char *host; int port; int r[3]; };
static void *own_loop(void *arg) {
    struct own_loop *a = arg;
    int s = dial(a->host, a->port, 0), fl = 1;
    ioctl(s, FIONBIO, &fl);
    int e = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = s}, out[4];
    epoll_ctl(e, EPOLL_CTL_ADD, s, &ev);
    a->r[0] = epoll_wait(e, out, 4, 100);
    cmd(s, "d");
    a->r[1] = epoll_wait(e, out, 4, 2000);
    char b[64];
    wait_bytes(s, 10);
    read(s, b, sizeof b);
    a->r[2] = epoll_wait(e, out, 4, 0);
    close(e); close(s);
    return NULL;
}

/* Another thread waiting on a given set (for `elide`). */
struct set_wait { int ep; int n; };
static void *wait_on_set(void *arg) {
    struct set_wait *w = arg;
    struct epoll_event out[4];
    w->n = epoll_wait(w->ep, out, 4, 5000);
    return NULL;
}

/* One thread's level-triggered epoll loop over two connections, as event loops have it, in a
 * process of its own: while nothing but that wait can see a connection, `netchannel run`
 * reports its readability from the wait itself instead of through the placeholder (elided).
 * Then what ends that (a second set, nesting, a fork) with readiness staying exact. */
static void elide(const char *host, int port) {
    int s1 = dial(host, port, 0), s2 = dial(host, port, 0);
    if (s1 < 0 || s2 < 0) { errno = s1 < 0 ? -s1 : -s2; die("connect"); }
    int fl = 1; ioctl(s1, FIONBIO, &fl); ioctl(s2, FIONBIO, &fl);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.fd = s1}, out[4];
    epoll_ctl(ep, EPOLL_CTL_ADD, s1, &ev);
    ev.data.fd = s2;
    epoll_ctl(ep, EPOLL_CTL_ADD, s2, &ev);
    char b[64];
    printf("elide idle: %d\n", epoll_wait(ep, out, 4, 100));
    cmd(s1, "d");
    int n = epoll_wait(ep, out, 4, 2000);
    printf("elide arrival: n=%d fd_is_s1=%d events=%#x\n", n, n == 1 && out[0].data.fd == s1,
           n >= 1 ? out[0].events & EMASK : 0);
    wait_bytes(s1, 10);
    printf("elide unread, level-triggered: %d\n", epoll_wait(ep, out, 4, 0));
    printf("elide read 4: %zd\n", read(s1, b, 4));
    printf("elide 6 left: %d\n", epoll_wait(ep, out, 4, 0));
    printf("elide read rest: %zd\n", read(s1, b, sizeof b));
    printf("elide drained: %d\n", epoll_wait(ep, out, 4, 0));
    ssize_t r = read(s1, b, sizeof b);
    printf("elide read empty: %s\n", res(r));

    /* Asleep in the wait when the data comes ('l': 10 bytes after 300 ms). */
    cmd(s2, "l");
    n = epoll_wait(ep, out, 4, 5000);
    printf("elide woken in the wait: n=%d fd_is_s2=%d\n", n, n == 1 && out[0].data.fd == s2);
    wait_bytes(s2, 10);
    printf("elide read: %zd\n", read(s2, b, sizeof b));

    /* Readable and writable: one event with both bits. */
    ev = (struct epoll_event){.events = EPOLLIN | EPOLLOUT, .data.fd = s1};
    epoll_ctl(ep, EPOLL_CTL_MOD, s1, &ev);
    cmd(s1, "d");
    wait_bytes(s1, 10);
    n = epoll_wait(ep, out, 4, 1000);
    printf("elide in+out: n=%d events=%#x\n", n, n >= 1 ? out[0].events & EMASK : 0);
    read(s1, b, sizeof b);
    n = epoll_wait(ep, out, 4, 1000);
    printf("elide out only: n=%d events=%#x\n", n, n >= 1 ? out[0].events & EMASK : 0);
    ev.events = EPOLLIN;
    epoll_ctl(ep, EPOLL_CTL_MOD, s1, &ev);

    /* Both readable, room for one event: level-triggered reports take turns. */
    cmd(s1, "d"); cmd(s2, "d");
    wait_bytes(s1, 10); wait_bytes(s2, 10);
    int f1 = -1, f2 = -1;
    if (epoll_wait(ep, out, 1, 1000) == 1) f1 = out[0].data.fd;
    if (epoll_wait(ep, out, 1, 1000) == 1) f2 = out[0].data.fd;
    printf("elide one at a time, both reported: %d\n", (f1 == s1 && f2 == s2) || (f1 == s2 && f2 == s1));
    read(s1, b, sizeof b); read(s2, b, sizeof b);
    printf("elide both drained: %d\n", epoll_wait(ep, out, 4, 0));

    /* Another thread runs its own loop meanwhile: each set's readiness is its own. */
    struct own_loop ol = {.host = host, .port = port};
    pthread_t th;
    pthread_create(&th, NULL, own_loop, &ol);
    cmd(s1, "d");
    n = epoll_wait(ep, out, 4, 2000);
    wait_bytes(s1, 10);
    read(s1, b, sizeof b);
    pthread_join(th, NULL);
    printf("elide beside another thread's loop: mine %d, theirs idle=%d arrival=%d drained=%d\n",
           n, ol.r[0], ol.r[1], ol.r[2]);

    /* Another thread waits on this set: it sees what arrives. */
    struct set_wait sw = {.ep = ep, .n = -1};
    pthread_create(&th, NULL, wait_on_set, &sw);
    usleep(100000);
    cmd(s2, "d");
    pthread_join(th, NULL);
    wait_bytes(s2, 10);
    printf("elide another thread waiting on the set: %d read %zd\n", sw.n, read(s2, b, sizeof b));

    /* A second set over one of them. */
    int ep2 = epoll_create1(0);
    ev = (struct epoll_event){.events = EPOLLIN, .data.fd = s2};
    epoll_ctl(ep2, EPOLL_CTL_ADD, s2, &ev);
    cmd(s2, "d"); wait_bytes(s2, 10);
    int a = epoll_wait(ep, out, 4, 1000), c = epoll_wait(ep2, out, 4, 1000);
    printf("elide second set: %d %d\n", a, c);
    read(s2, b, sizeof b);
    a = epoll_wait(ep, out, 4, 0), c = epoll_wait(ep2, out, 4, 0);
    printf("elide second set drained: %d %d\n", a, c);
    close(ep2);

    /* Nested in another set. */
    int outer = epoll_create1(0);
    ev = (struct epoll_event){.events = EPOLLIN, .data.fd = ep};
    epoll_ctl(outer, EPOLL_CTL_ADD, ep, &ev);
    cmd(s1, "d"); wait_bytes(s1, 10);
    a = epoll_wait(outer, out, 4, 1000), c = epoll_wait(ep, out, 4, 0);
    printf("elide nested: outer=%d inner=%d\n", a, c);
    read(s1, b, sizeof b);
    printf("elide nested drained: outer=%d\n", epoll_wait(outer, out, 4, 0));
    close(outer);

    /* A fresh connection in a fresh set, then a fork: the child waits on its copy of the set
     * and must see the parent's next arrival. */
    int s3 = dial(host, port, 0);
    ioctl(s3, FIONBIO, &fl);
    int ep3 = epoll_create1(0);
    ev = (struct epoll_event){.events = EPOLLIN, .data.fd = s3};
    epoll_ctl(ep3, EPOLL_CTL_ADD, s3, &ev);
    printf("elide fresh: %d\n", epoll_wait(ep3, out, 4, 100));
    cmd(s3, "d"); wait_bytes(s3, 10);
    printf("elide fresh arrival: %d\n", epoll_wait(ep3, out, 4, 1000));
    read(s3, b, sizeof b);
    pid_t pid = fork();
    if (pid == 0) _exit(epoll_wait(ep3, out, 4, 5000) == 1 ? 0 : 1);
    usleep(200000);
    cmd(s3, "d");
    int st = 0;
    waitpid(pid, &st, 0);
    printf("elide forked child sees the arrival: %d\n", WIFEXITED(st) && WEXITSTATUS(st) == 0);
    wait_bytes(s3, 10);
    n = epoll_wait(ep3, out, 4, 1000);
    printf("elide parent after the fork: %d read %zd\n", n, read(s3, b, sizeof b));

    /* A set made before a fork, a connection added to it after: the child, waiting on its copy
     * of the set, sees that connection's arrival (the kernel set is one). */
    int ep4 = epoll_create1(0), go[2];
    if (pipe(go)) die("pipe");
    pid = fork();
    if (pid == 0) {
        char x;
        if (read(go[0], &x, 1) != 1) _exit(2);
        _exit(epoll_wait(ep4, out, 4, 5000) == 1 ? 0 : 1);
    }
    int s4 = dial(host, port, 0);
    ev = (struct epoll_event){.events = EPOLLIN, .data.fd = s4};
    epoll_ctl(ep4, EPOLL_CTL_ADD, s4, &ev);
    printf("elide set older than a fork: %d\n", epoll_wait(ep4, out, 4, 100));
    if (write(go[1], "x", 1) != 1) die("write");
    usleep(200000);
    cmd(s4, "d");
    waitpid(pid, &st, 0);
    printf("elide child sees a connection added after the fork: %d\n", WIFEXITED(st) && WEXITSTATUS(st) == 0);
    wait_bytes(s4, 10);
    read(s4, b, sizeof b);
    close(ep4); close(s4); close(go[0]); close(go[1]);

    /* The peer's FIN. */
    cmd(s1, "s");
    n = epoll_wait(ep, out, 4, 2000);
    int fin = n >= 1 ? out[0].events & EMASK : 0;
    printf("elide fin: n=%d events=%#x read=%s\n", n, fin, res(read(s1, b, sizeof b)));
    close(ep); close(ep3);
    close(s1); close(s2); close(s3);
}

/* Threads blocked in poll(2) on connections that stay idle, beside a thread exchanging messages
 * on its own connection to the same host: kernel TCP never wakes them. Carried, they share the
 * engine's channels with the busy connection; a thread that sleeps serving those channels may
 * wake for one of the busy connection's events (and hand it over), but not every sleeping
 * thread for every event: their wake-ups stay below one per exchange. */
#define HERD_IDLE 8
#define HERD_ROUNDS 1000
static long herd_wakes[HERD_IDLE];
static int herd_fds[HERD_IDLE];
static pthread_barrier_t herd_ready;

static long voluntary_switches(void) {
    struct rusage u;
    getrusage(RUSAGE_THREAD, &u);
    return u.ru_nvcsw;
}

static void *herd_idle(void *arg) {
    long i = (long)arg;
    int s = herd_fds[i];
    long before = voluntary_switches();
    pthread_barrier_wait(&herd_ready);
    struct pollfd p = {.fd = s, .events = POLLIN};
    int n = poll(&p, 1, 30000);
    /* One wake-up ends the wait: the 'd' the main thread sends when it is done. */
    herd_wakes[i] = voluntary_switches() - before - 1;
    char b[10];
    if (n != 1 || read_full(s, b, 10) != 10) herd_wakes[i] = -1000000;
    return NULL;
}

static void herd(const char *host, int port) {
    pthread_t t[HERD_IDLE];
    pthread_barrier_init(&herd_ready, NULL, HERD_IDLE + 1);
    for (long i = 0; i < HERD_IDLE; i++) {
        herd_fds[i] = dial(host, port, 0);
        if (herd_fds[i] < 0) { errno = -herd_fds[i]; die("herd connect"); }
        pthread_create(&t[i], NULL, herd_idle, (void *)i);
    }
    int s = dial(host, port, 0);
    if (s < 0) { errno = -s; die("herd connect"); }
    pthread_barrier_wait(&herd_ready);
    usleep(100000); /* every idle thread is in poll */
    int ok = 1;
    for (int r = 0; r < HERD_ROUNDS && ok; r++) {
        char b[4];
        write(s, "eabcd", 5);
        struct pollfd p = {.fd = s, .events = POLLIN};
        ok = poll(&p, 1, 5000) == 1 && read_full(s, b, 4) == 4 && !memcmp(b, "abcd", 4);
    }
    for (int i = 0; i < HERD_IDLE; i++) write(herd_fds[i], "d", 1);
    long total = 0;
    for (int i = 0; i < HERD_IDLE; i++) {
        pthread_join(t[i], NULL);
        total += herd_wakes[i];
        close(herd_fds[i]);
    }
    close(s);
    fprintf(stderr, "herd: %d exchanges, idle pollers woke %ld times\n", HERD_ROUNDS, total);
    printf("herd: exchanges done=%d idle pollers woke less than once per exchange=%d\n", ok,
           total >= 0 && total < HERD_ROUNDS);
}

/* A non-blocking connect to an address nobody answers (no ARP reply) returns at once. */
static void unreachable(const char *host, int port) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int s = dial(host, port, 1);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
    printf("unreachable: in progress=%d returned within 1 s=%d\n", s >= 0, secs < 1.0);
    if (s >= 0) close(s);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 3 && !strcmp(argv[1], "server")) server(atoi(argv[2]));
    else if (argc == 4 && !strcmp(argv[1], "client")) client(argv[2], atoi(argv[3]));
    else if (argc == 4 && !strcmp(argv[1], "unreachable")) unreachable(argv[2], atoi(argv[3]));
    else if (argc == 3 && !strcmp(argv[1], "exec-child")) exec_child(atoi(argv[2]));
    else if (argc == 4 && !strcmp(argv[1], "scm-nolib")) scm_nolib(argv[2], atoi(argv[3]));
    else if (argc == 4 && !strcmp(argv[1], "elide")) elide(argv[2], atoi(argv[3]));
    else if (argc == 4 && !strcmp(argv[1], "herd")) herd(argv[2], atoi(argv[3]));
    else if (argc == 6 && !strcmp(argv[1], "rounds")) rounds(argv[2], argv[3], atoi(argv[4]), atoi(argv[5]), "/proc/self/exe");
    else if (argc == 3 && !strcmp(argv[1], "scm-recv")) return scm_recv(atoi(argv[2]));
    else if (argc == 2 && !strcmp(argv[1], "spawn-child")) return spawn_child();
    else if (argc == 4 && !strcmp(argv[1], "exit-writer")) return exit_writer(argv[2], atoi(argv[3]));
    else { fprintf(stderr, "usage: conform server PORT | client HOST PORT | scm-nolib HOST PORT\n"); return 2; }
    return 0;
}
