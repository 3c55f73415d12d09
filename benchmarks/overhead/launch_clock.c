/* Launch clock for benchmarks/overhead/bench_overhead.py: preloaded (LD_PRELOAD) in front of the CUDA
 * runtime, it notes the CLOCK_MONOTONIC time (the clock of Python's time.perf_counter_ns) at which
 * the first kernel launch since the last read enters the runtime, then forwards the launch
 * unchanged. verl_ops_launch_clock_take() returns that time (0 if nothing launched) and re-arms.
 *
 * Intercepted: __cudaLaunchKernel / __cudaLaunchKernel_ptsz (the entry points of nvcc's <<<>>>
 * stubs since CUDA 12.x, verl_ops' kernels and torch's), cudaLaunchKernel and cudaLaunchKernelExC
 * (explicit launches). The dim3 arguments are passed as the same 12-byte struct of three
 * unsigned ints, so the calling convention is the runtime's own.
 *
 * Build: cc -O2 -shared -fPIC -o launch_clock.so launch_clock.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef struct {
  unsigned int x, y, z;
} vo_dim3;

typedef int (*vo_launch_fn)(const void*, vo_dim3, vo_dim3, void**, size_t, void*);
typedef int (*vo_launch_ex_fn)(const void*, const void*, void**);

static volatile int64_t vo_first_ns = 0;

static int64_t vo_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec;
}

static void vo_mark(void) {
  if (vo_first_ns == 0) vo_first_ns = vo_now_ns();
}

/* The runtime's own definition: the next one in the global scope, else the loaded libcudart. */
static void* vo_real(const char* name) {
  void* f = dlsym(RTLD_NEXT, name);
  if (f) return f;
  static const char* libs[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
  for (size_t i = 0; i < sizeof(libs) / sizeof(libs[0]); ++i) {
    void* h = dlopen(libs[i], RTLD_LAZY | RTLD_NOLOAD);
    if (h && (f = dlsym(h, name))) return f;
  }
  return NULL;
}

#define VO_FORWARD_LAUNCH(NAME)                                                              \
  int NAME(const void* k, vo_dim3 g, vo_dim3 b, void** a, size_t shm, void* stream) {        \
    static vo_launch_fn real = NULL;                                                         \
    vo_mark();                                                                               \
    if (!real) real = (vo_launch_fn)vo_real(#NAME);                                          \
    return real ? real(k, g, b, a, shm, stream) : 1; /* 1: cudaErrorInvalidValue */         \
  }

VO_FORWARD_LAUNCH(__cudaLaunchKernel)
VO_FORWARD_LAUNCH(__cudaLaunchKernel_ptsz)
VO_FORWARD_LAUNCH(cudaLaunchKernel)

int cudaLaunchKernelExC(const void* config, const void* func, void** args) {
  static vo_launch_ex_fn real = NULL;
  vo_mark();
  if (!real) real = (vo_launch_ex_fn)vo_real("cudaLaunchKernelExC");
  return real ? real(config, func, args) : 1;
}

int64_t verl_ops_launch_clock_take(void) {
  const int64_t t = vo_first_ns;
  vo_first_ns = 0;
  return t;
}

/* Whether the runtime's launch entry points were found (0 = no libcudart loaded yet). */
int verl_ops_launch_clock_ready(void) { return vo_real("__cudaLaunchKernel") != NULL; }
