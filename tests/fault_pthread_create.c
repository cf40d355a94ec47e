/* LD_PRELOAD shim for test_native_faults.py: with FAULT_PTHREAD_CREATE_OK=k set,
 * only the next k pthread_create calls succeed, then they fail with EAGAIN (as
 * when a process hits its thread limit), until the variable changes or is unset. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char last[32];
static long left;

int pthread_create(pthread_t* t, const pthread_attr_t* a, void* (*fn)(void*), void* arg) {
  static int (*real)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  if (!real) real = (int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*))dlsym(RTLD_NEXT, "pthread_create");
  const char* v = getenv("FAULT_PTHREAD_CREATE_OK");
  pthread_mutex_lock(&mu);
  int refuse = 0;
  if (!v) {
    last[0] = 0;
  } else {
    if (strncmp(v, last, sizeof last)) {
      strncpy(last, v, sizeof last - 1);
      left = atol(v);
    }
    refuse = left <= 0;
    if (!refuse) --left;
  }
  pthread_mutex_unlock(&mu);
  if (refuse) return EAGAIN;
  return real(t, a, fn, arg);
}
