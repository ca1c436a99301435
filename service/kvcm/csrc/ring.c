/* ring.c: the busy-poll mode's watch of the step rings' request words (kvcm.server.step_ring,
 * docs/step-channel.md, "The shared-memory ring").
 *
 * Why in C: in Python each look at a ring is a generator, a method call and a memoryview
 * index, ~0.3 us; the spin looked 16 times between two polls of the sockets, so a frame
 * waited ~5 us at the median to be seen on the development VM. Here a look is one load, and
 * the loop pauses (PAUSE) between looks, so the client's store is seen within a fraction of a
 * microsecond of landing, and the core's sibling thread, if any, keeps its share. */
#include "native.h"

#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVCM_PAUSE() _mm_pause()
#else
#define KVCM_PAUSE() ((void)0)
#endif

/* Rings watched in one call at most (the service keeps MAX_RINGS = 64). */
#define MAX_WATCHED 64
/* Looks between two reads of the clock (a read is ~20-50 ns through the vDSO). */
#define LOOKS_PER_CLOCK 32

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ring_watch(words, index, wants, ns) -> int: the position in `words` (buffers of uint64
 * words, each a ring's header) of the first whose word `index` equals the same position of
 * `wants` (tuples of equal length), looking for up to `ns` nanoseconds (0: one look); -1
 * when none did in that time, or at once when there is none to watch. The GIL is held: the caller is the event loop's thread, which the watch keeps
 * busy anyway, and a watch lasts microseconds (the caller's budget).
 *
 * Example: words (ringA, ringB), index 8, wants (4, 11), ns 8000: returns 1 once ringB's word
 * 8 reads 11 (its client posted frame 11), -1 after 8 us if neither client posted. */
PyObject *kvcm_ring_watch(PyObject *self, PyObject *args) {
    PyObject *words, *wants;
    Py_ssize_t index;
    long long budget;
    if (!PyArg_ParseTuple(args, "O!nO!L", &PyTuple_Type, &words, &index, &PyTuple_Type, &wants,
                          &budget))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(words);
    if (n != PyTuple_GET_SIZE(wants) || n > MAX_WATCHED || index < 0) {
        PyErr_SetString(PyExc_ValueError, "ring_watch: words and wants must match (64 at most)");
        return NULL;
    }
    Py_buffer views[MAX_WATCHED];
    const volatile uint64_t *seq[MAX_WATCHED];
    uint64_t want[MAX_WATCHED];
    Py_ssize_t got = 0;
    long found = -1;
    for (; got < n; got++) {
        PyObject *w = PyTuple_GET_ITEM(wants, got);
        want[got] = PyLong_AsUnsignedLongLong(w);
        if (want[got] == (uint64_t)-1 && PyErr_Occurred())
            goto done;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(words, got), &views[got], PyBUF_SIMPLE) < 0)
            goto done;
        if (index >= views[got].len / (Py_ssize_t)sizeof(uint64_t) ||
            (uintptr_t)views[got].buf % sizeof(uint64_t)) {
            PyBuffer_Release(&views[got]);
            PyErr_SetString(PyExc_ValueError,
                            "ring_watch: index past a ring's words, or words not aligned");
            goto done;
        }
        seq[got] = (const volatile uint64_t *)views[got].buf + index;
    }
    if (n == 0) /* nothing to watch: the caller polls its sockets at once */
        goto done;
    int64_t until = now_ns() + budget;
    for (unsigned looks = 0;; looks++) { /* the clock at the first look too: ns 0 looks once */
        for (Py_ssize_t i = 0; i < n; i++) {
            if (*seq[i] == want[i]) {
                found = (long)i;
                goto done;
            }
        }
        if (looks % LOOKS_PER_CLOCK == 0 && now_ns() >= until)
            break;
        KVCM_PAUSE();
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(found);
}
