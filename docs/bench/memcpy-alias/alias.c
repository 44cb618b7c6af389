/* memcpy speed by the destination's distance above the source, modulo a 4 KiB page.
 * Usage: alias SIZE ITERATIONS DISTANCE [PIECE]
 * Copies SIZE bytes from one page-aligned buffer to 64 page-aligned buffers in turn, each
 * at DISTANCE bytes past its page boundary, in memcpy calls of PIECE bytes (default: one
 * call), and prints GB/s. Build: gcc -O2 -o /tmp/alias alias.c */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s SIZE ITERATIONS DISTANCE [PIECE]\n", argv[0]);
        return 2;
    }
    size_t size = strtoul(argv[1], 0, 0), piece = argc > 4 ? strtoul(argv[4], 0, 0) : size;
    long iterations = atol(argv[2]);
    size_t distance = strtoul(argv[3], 0, 0);
    enum { BUFFERS = 64 };
    char *src = aligned_alloc(4096, size + 4096), *dst[BUFFERS];
    memset(src, 1, size + 4096);
    for (int i = 0; i < BUFFERS; i++) {
        dst[i] = aligned_alloc(4096, size + 8192);
        memset(dst[i], 0, size + 8192);
    }
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < iterations; i++) {
        char *d = dst[i % BUFFERS] + distance;
        for (size_t at = 0; at < size; at += piece)
            memcpy(d + at, src + at, size - at < piece ? size - at : piece);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double s = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9;
    printf("size %zu distance %zu piece %zu: %.1f GB/s\n", size, distance, piece,
           (double)size * iterations / s / 1e9);
    return 0;
}
