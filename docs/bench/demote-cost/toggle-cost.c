/* What one demotion toggle costs on this machine: a thread switches itself to SCHED_IDLE and back
 * 200,000 times, with the five calls the engine made per toggle before 2026-11-25 midday
 * (sched_getscheduler, getpriority, sched_setscheduler twice, setpriority), with the three it
 * makes now, and with the two sets alone. Also checks that a SCHED_IDLE round trip keeps nice.
 * Build and run: gcc -O2 toggle-cost.c -o /tmp/toggle-cost && /tmp/toggle-cost */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  pid_t tid=syscall(SYS_gettid);
  setpriority(PRIO_PROCESS,tid,3);
  struct sched_param p={0};
  sched_setscheduler(0,SCHED_IDLE,&p);
  sched_setscheduler(0,SCHED_OTHER,&p);
  printf("nice after idle round trip: %d\n", getpriority(PRIO_PROCESS,tid));
  setpriority(PRIO_PROCESS,tid,0);
  int N=200000; double t=now();
  for(int i=0;i<N;i++){int pol=sched_getscheduler(0);int n=getpriority(PRIO_PROCESS,tid);sched_setscheduler(0,SCHED_IDLE,&p);sched_setscheduler(0,pol,&p);setpriority(PRIO_PROCESS,tid,n);}
  printf("5 calls: %.0f ns\n",(now()-t)/N*1e9);
  t=now();
  for(int i=0;i<N;i++){int pol=sched_getscheduler(0);sched_setscheduler(0,SCHED_IDLE,&p);sched_setscheduler(0,pol,&p);}
  printf("3 calls: %.0f ns\n",(now()-t)/N*1e9);
  t=now();
  for(int i=0;i<N;i++){sched_setscheduler(0,SCHED_IDLE,&p);sched_setscheduler(0,SCHED_OTHER,&p);}
  printf("2 calls: %.0f ns\n",(now()-t)/N*1e9);
  t=now();
  for(int i=0;i<N;i++){getpriority(PRIO_PROCESS,tid);}
  printf("getpriority: %.0f ns\n",(now()-t)/N*1e9);
}
