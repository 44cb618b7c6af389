/* 64-byte ping-pong between two processes over a Unix socketpair or loopback TCP: what one
 * round trip costs on this machine (docs/BENCHMARKS.md, "Unmodified applications").
 *   cc -O2 -o /tmp/pp scripts/unix-vs-tcp-pingpong.c && /tmp/pp unix && /tmp/pp tcp */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec/1e9;}
int main(int argc,char**argv){
  int n=200000, sv[2];
  if(!strcmp(argv[1],"unix")) socketpair(AF_UNIX,SOCK_STREAM,0,sv);
  else { int l=socket(AF_INET,SOCK_STREAM,0); struct sockaddr_in a={.sin_family=AF_INET}; a.sin_addr.s_addr=htonl(0x7f000001);
    bind(l,(void*)&a,sizeof a); listen(l,1); socklen_t al=sizeof a; getsockname(l,(void*)&a,&al);
    sv[0]=socket(AF_INET,SOCK_STREAM,0); connect(sv[0],(void*)&a,sizeof a); sv[1]=accept(l,0,0); int one=1;
    setsockopt(sv[0],IPPROTO_TCP,TCP_NODELAY,&one,4); setsockopt(sv[1],IPPROTO_TCP,TCP_NODELAY,&one,4);}
  char b[64];
  if(fork()==0){ for(int i=0;i<n;i++){ read(sv[1],b,64); write(sv[1],b,64);} _exit(0);}
  double t0=now(); clock_t c0=clock();
  for(int i=0;i<n;i++){ write(sv[0],b,64); int g=0; while(g<64) g+=read(sv[0],b+g,64-g);}
  double t=now()-t0; wait(0);
  printf("%s: %.2f us per round trip\n",argv[1],t/n*1e6);
}
