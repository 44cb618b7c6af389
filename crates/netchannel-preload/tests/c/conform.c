/* Socket semantics that programs rely on, printed as lines that must be identical under
 * `netchannel run` and on plain kernel TCP. `conform server PORT` / `conform client HOST PORT`
 * / `conform unreachable HOST PORT`. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what) { printf("FAIL %s: %s\n", what, strerror(errno)); exit(1); }

static int wait_ev(int ep, int ms) {
    struct epoll_event ev[4];
    return epoll_wait(ep, ev, 4, ms);
}

/* Commands: 'd' send 10 bytes; 's' shut down writing; 'e' echo 4 bytes; 'q' quit; 'h' hold
 * (read nothing more: partial writes); 'w' read to EOF, then answer "done"; 'f' answer whether
 * accept4 made the fd close-on-exec and non-blocking; 'x' close at once. */
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
    }
    close(c);
    return NULL;
}

static void server(int port) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (bind(l, (void *)&a, sizeof a) || listen(l, 16)) die("listen");
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

static int read_full(int s, char *b, int len) {
    int got = 0;
    while (got < len) { ssize_t r = read(s, b + got, len - got); if (r <= 0) break; got += r; }
    return got;
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

    s = dial(host, port, 0);
    write(s, "q", 1);
    close(s);
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
    else { fprintf(stderr, "usage: conform server PORT | client HOST PORT\n"); return 2; }
    return 0;
}
