#define _GNU_SOURCE
// Receiver-side kernel copy cost by the receive buffer's offset modulo a page.
// A sender thread writes page-aligned 256 KiB blocks; the receiver reads 64 KiB at buf+off.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <pthread.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <time.h>
static int port; static volatile int stop;
static void *sender(void *x) {
  int s = socket(AF_INET, SOCK_STREAM, 0); struct sockaddr_in a = {AF_INET, htons(port), {htonl(0x7f000001)}};
  connect(s, (void*)&a, sizeof a);
  char *b = aligned_alloc(4096, 256<<10); memset(b, 1, 256<<10);
  long hdr = (long)x;
  if (hdr) write(s, b, hdr);
  while (!stop) if (write(s, b, 256<<10) <= 0) break;
  close(s); return 0;
}
static double cpu(void) { struct rusage r; getrusage(RUSAGE_THREAD, &r); return r.ru_stime.tv_sec + r.ru_stime.tv_usec/1e6; }
int main(int argc, char **argv) {
  int off = atoi(argv[1]); long shift = argc > 2 ? atol(argv[2]) : 0;
  int l = socket(AF_INET, SOCK_STREAM, 0); int one = 1; setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, 4);
  struct sockaddr_in a = {AF_INET, 0, {htonl(0x7f000001)}}; bind(l, (void*)&a, sizeof a); listen(l, 1);
  socklen_t al = sizeof a; getsockname(l, (void*)&a, &al); port = ntohs(a.sin_port);
  pthread_t t; pthread_create(&t, 0, sender, (void*)shift);
  int c = accept(l, 0, 0);
  char *buf = aligned_alloc(4096, 1<<20);
  long total = 0, want = 512L<<20;
  if (shift) { char tmp[8192]; long g = 0; while (g < shift) g += read(c, tmp, shift - g); }
  struct timespec t0, t1; clock_gettime(CLOCK_MONOTONIC, &t0); double s0 = cpu();
  while (total < want) { ssize_t n = read(c, buf + off, 64<<10); if (n <= 0) break; total += n; }
  clock_gettime(CLOCK_MONOTONIC, &t1); double s1 = cpu();
  stop = 1; close(c);
  double el = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec)/1e9;
  printf("off %5d shift %5ld: %.2f GB/s, receiver sys %.3f s per GB\n", off, shift, total/el/1e9, (s1-s0)/(total/1e9));
  return 0;
}
