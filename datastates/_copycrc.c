/* One pass over a saved byte: copy it into the host cache and fold it into the chunk's CRC-32C
 * in the same loop (datastates/copycrc.py loads this with ctypes; see there for why).
 *
 * ds_copy_crc32c(dst, src, n, crc, stream) copies n bytes from src to dst and returns the CRC-32C
 * of those bytes continued from `crc`, with the same convention as the `crc32c` package's
 * crc32c(data, value): the result of one call is the `crc` of the next, 0 starts a new chunk.
 *
 * Why one loop is cheaper than memcpy then crc32c on this kind of machine:
 *  - glibc's memcpy uses ordinary stores below its non-temporal threshold (192 MiB here), so every
 *    destination line is first read from memory (read for ownership), then written back: three
 *    memory transfers per byte. With `stream` set, the stores here are non-temporal (movnti): two.
 *  - a separate crc32c pass reads the copied bytes from memory once more; here each word is
 *    checksummed while it is in a register.
 *  - the crc32 instruction has a 3-cycle latency and issues once per cycle, so three independent
 *    CRCs run over three consecutive thirds of each block and are combined: crc(A|B|C) =
 *    shift(shift(crc(A)) ^ crc0(B)) ^ crc0(C), shift being the CRC register after STRIDE zero
 *    bytes, a linear map applied with four 256-entry tables built at load time.
 */
#include <nmmintrin.h>
#include <xmmintrin.h>
#include <stdint.h>
#include <string.h>

#define STRIDE 4096u /* bytes per stream in one block of 3 * STRIDE */

/* PREFETCH: each stream of a block is a page's worth of bytes (4 KiB, across two pages when the
 * source is not page-aligned), and the hardware's stream prefetchers stop at page boundaries, so
 * every block would start with three cold misses from memory. The loop
 * therefore prefetches the next block's three pages while it copies this one. Measured on our
 * 2-core Zen 2 VM, 1 GiB from 4 KiB-page memory, one thread: 0.102-0.110 CPU-s without,
 * 0.074-0.086 with (a plain SSE2 non-temporal copy without checksum: 0.093-0.101); prefetching
 * only 512 B-2 KiB ahead within the same page was slower (0.108-0.125). */

static uint32_t shift_table[4][256];
static int shift_ready;

static uint32_t crc_zeros(uint32_t r, size_t n)
{
    uint64_t r64 = r;
    for (size_t i = 0; i < n; i += 8)
        r64 = _mm_crc32_u64(r64, 0);
    return (uint32_t)r64;
}

/* Must be called once before ds_copy_crc32c (copycrc.py does, at load). */
int ds_copy_crc32c_init(void)
{
    if (!__builtin_cpu_supports("sse4.2"))
        return 0;
    uint32_t basis[32];
    for (int j = 0; j < 32; j++)
        basis[j] = crc_zeros(1u << j, STRIDE);
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 256; b++) {
            uint32_t v = 0;
            for (int j = 0; j < 8; j++)
                if (b & (1 << j))
                    v ^= basis[8 * k + j];
            shift_table[k][b] = v;
        }
    shift_ready = 1;
    return 1;
}

static inline uint32_t shift(uint32_t r)
{
    return shift_table[0][r & 0xff] ^ shift_table[1][(r >> 8) & 0xff] ^
           shift_table[2][(r >> 16) & 0xff] ^ shift_table[3][r >> 24];
}

static inline uint64_t load64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline void store64(unsigned char *p, uint64_t v, int stream)
{
    if (stream)
        _mm_stream_si64((long long *)p, (long long)v);
    else
        memcpy(p, &v, 8);
}

uint32_t ds_copy_crc32c(void *dst_, const void *src_, size_t n, uint32_t crc, int stream)
{
    unsigned char *dst = dst_;
    const unsigned char *src = src_;
    uint32_t r = ~crc;
    /* movnti wants an 8-byte aligned destination: reach one with ordinary byte stores. */
    while (n && ((uintptr_t)dst & 7)) {
        *dst = *src;
        r = _mm_crc32_u8(r, *src);
        dst++, src++, n--;
    }
    while (shift_ready && n >= 3 * STRIDE) {
        uint64_t a = r, b = 0, c = 0;
        /* The next block's three pages, a line per 64 bytes copied (see PREFETCH above). */
        const unsigned char *next = n >= 6 * STRIDE ? src + 3 * STRIDE : NULL;
        for (size_t i = 0; i < STRIDE; i += 8) {
            if (next && !(i & 63)) {
                _mm_prefetch((const char *)next + i, _MM_HINT_T0);
                _mm_prefetch((const char *)next + STRIDE + i, _MM_HINT_T0);
                _mm_prefetch((const char *)next + 2 * STRIDE + i, _MM_HINT_T0);
            }
            uint64_t x = load64(src + i), y = load64(src + STRIDE + i),
                     z = load64(src + 2 * STRIDE + i);
            a = _mm_crc32_u64(a, x);
            b = _mm_crc32_u64(b, y);
            c = _mm_crc32_u64(c, z);
            store64(dst + i, x, stream);
            store64(dst + STRIDE + i, y, stream);
            store64(dst + 2 * STRIDE + i, z, stream);
        }
        r = shift(shift((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
        src += 3 * STRIDE, dst += 3 * STRIDE, n -= 3 * STRIDE;
    }
    uint64_t r64 = r;
    for (; n >= 8; src += 8, dst += 8, n -= 8) {
        uint64_t x = load64(src);
        r64 = _mm_crc32_u64(r64, x);
        store64(dst, x, stream);
    }
    r = (uint32_t)r64;
    for (; n; src++, dst++, n--) {
        *dst = *src;
        r = _mm_crc32_u8(r, *src);
    }
    if (stream)
        _mm_sfence(); /* the writer thread (and the O_DIRECT DMA) must see every byte */
    return ~r;
}
