// Keeps the blocks CPython frees from a thread's frame stack for reuse, instead of unmapping them
// (runner/frame_chunks.py says when and why it is installed).
//
// Since 3.11 a thread's Python frames live in a stack of chunks (16 KiB; more for a huge frame):
// a call that does not fit in the current chunk maps a new one (_PyThreadState_PushFrame), and
// its return unmaps it again (_PyThreadState_PopFrame). A call path that crosses a chunk's edge
// in a loop pays an mmap, four page faults and an munmap each time; the munmap also interrupts
// every other CPU the process runs on (a TLB shootdown; a VM's costs more), and the kernels'
// OpenMP threads spin on those CPUs between ops. A decode step crosses it in every layer.
//
// The chunks come from the interpreter's arena allocator (PyObject_SetArenaAllocator, public
// API since 3.4), which pymalloc's arenas (256 KiB or 1 MiB) share. This one keeps up to kKeep
// freed blocks of at most kMaxKept bytes and hands one out again for a request of its size;
// everything else goes to the allocator it replaced, which also frees what it gave out before.
#include <Python.h>

#include <cstddef>
#include <mutex>

namespace {

constexpr int kKeep = 8;                  // a few chunks: one edge crossed per call depth
constexpr std::size_t kMaxKept = 64 << 10;  // frame chunks, never pymalloc's arenas

struct Block {
  void* ptr;
  std::size_t size;
};

PyObjectArenaAllocator previous;
Block kept[kKeep];
int num_kept = 0;
bool installed = false;
// The GIL serialises the allocator's calls, except in a free-threaded build.
std::mutex mutex;

void* allocate(void* /*ctx*/, std::size_t size) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (int i = num_kept - 1; i >= 0; --i) {
      if (kept[i].size == size) {
        void* ptr = kept[i].ptr;
        kept[i] = kept[--num_kept];
        return ptr;
      }
    }
  }
  return previous.alloc(previous.ctx, size);
}

void release(void* /*ctx*/, void* ptr, std::size_t size) {
  if (size <= kMaxKept) {
    std::lock_guard<std::mutex> lock(mutex);
    if (num_kept < kKeep) {
      kept[num_kept++] = {ptr, size};
      return;
    }
  }
  previous.free(previous.ctx, ptr, size);
}

}  // namespace

// Installs the allocator above once per process; 1 if this call installed it. Called through
// ctypes.PyDLL, which holds the GIL.
extern "C" int pagedllm_keep_frame_chunks() {
  if (installed) return 0;
  PyObject_GetArenaAllocator(&previous);
  PyObjectArenaAllocator keeping{nullptr, allocate, release};
  PyObject_SetArenaAllocator(&keeping);
  installed = true;
  return 1;
}
