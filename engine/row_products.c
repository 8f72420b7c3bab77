/* The products of a few rows with a linear layer's weight on a CPU, float32:
   y = x W^T + b for a decoding step's rows. Built and loaded by
   engine/row_products.py, which says why it exists.

   The weight is laid out in blocks of BLOCK output columns, each block's
   columns side by side for every input ([blocks][in][BLOCK], the last block
   padded with zeros), so that a block is one stream of memory and one input's
   BLOCK weights are one vector (two with AVX2). Each output is its bias plus
   the products of its inputs added in order, one fused multiply-add at a
   time (no -ffast-math: nothing is reordered), whatever the tile it is
   computed in: a row's answer is the same bits whatever rows are computed
   beside it. */
#include <omp.h>
#include <stdint.h>

#define BLOCK 16
#define INLINE static inline __attribute__((always_inline))

/* A tile is ROWS rows by COLS blocks, its sums held in registers: 32 vector
   registers of 16 floats with AVX-512, 16 of 8 with AVX2 (a block is then
   two). The fewer the rows, the more blocks a tile takes, so that several
   sums are in flight at once. */
#ifdef __AVX512F__
#define LANES 16
#define TILE_ROWS 8
#define TILE_BLOCKS(rows) ((rows) <= 2 ? 4 : 2)
#else
#define LANES 8
#define TILE_ROWS 4
#define TILE_BLOCKS(rows) ((rows) <= 1 ? 4 : (rows) <= 2 ? 2 : 1)
#endif
#define PARTS (BLOCK / LANES) /* vectors a block holds */
typedef float vec __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
/* Blocks computed for every row before the next: a few hundred KB of
   weights, still in the core's cache for the rows' second tile. */
#define GROUP 4

/* ``rows`` rows of ``x`` by ``cols`` blocks of ``w`` (``block_stride`` floats
   apart), into ``y``; ``width``: the columns of the last block to write. */
INLINE void tile(const float *restrict x, int64_t x_stride, const float *restrict w,
                 int64_t block_stride, const float *restrict bias, float *restrict y,
                 int64_t y_stride, int64_t in, const int rows, const int cols, int64_t width)
{
    vec acc[TILE_ROWS][4 * PARTS]; /* TILE_BLOCKS is at most 4 */
    for (int c = 0; c < cols * PARTS; c++) {
        vec start = {0};
        if (bias) start = *(const vec *)(bias + c * LANES);
        for (int r = 0; r < rows; r++) acc[r][c] = start;
    }
    for (int64_t k = 0; k < in; k++) {
        for (int c = 0; c < cols; c++) {
            for (int p = 0; p < PARTS; p++) {
                const vec wk = *(const vec *)(w + c * block_stride + k * BLOCK + p * LANES);
                for (int r = 0; r < rows; r++) acc[r][c * PARTS + p] += x[r * x_stride + k] * wk;
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < cols * PARTS; c++) {
            float *yc = y + r * y_stride + c * LANES;
            const int64_t left = c < (cols - 1) * PARTS ? LANES : width - (c % PARTS) * LANES;
            if (left >= LANES) {
                *(vec *)yc = acc[r][c];
            } else {
                float last[LANES];
                *(vec *)last = acc[r][c];
                for (int64_t j = 0; j < left; j++) yc[j] = last[j];
            }
        }
    }
}

/* ``rows`` (at most TILE_ROWS) rows by the ``count`` blocks from block ``b``. */
INLINE void tile_group(const float *restrict x, int64_t x_stride, const float *restrict w,
                       const float *restrict bias, float *restrict y, int64_t y_stride,
                       int64_t in, int64_t out, int64_t b, int64_t count, const int rows)
{
    const int wide = TILE_BLOCKS(rows);
    const int64_t block_stride = in * BLOCK;
    int64_t j = 0;
    for (; j + wide <= count && (b + j + wide) * BLOCK <= out; j += wide)
        tile(x, x_stride, w + (b + j) * block_stride, block_stride,
             bias ? bias + (b + j) * BLOCK : 0, y + (b + j) * BLOCK, y_stride, in, rows, wide,
             BLOCK);
    for (; j < count; j++) {
        const int64_t left = out - (b + j) * BLOCK;
        tile(x, x_stride, w + (b + j) * block_stride, block_stride,
             bias ? bias + (b + j) * BLOCK : 0, y + (b + j) * BLOCK, y_stride, in, rows, 1,
             left < BLOCK ? left : BLOCK);
    }
}

/* y (``rows`` by ``out``, rows ``y_stride`` apart) = x (``rows`` by ``in``,
   rows ``x_stride`` apart) times the blocked weight ``w``, plus ``bias``
   (padded like the weight, or NULL). The blocks are split evenly between
   the calling thread's OpenMP threads (torch's own pool, as its products),
   each taking a run of them: equal shares whatever the tile width. */
void lmsp_row_products(const float *x, int64_t x_stride, int64_t rows, int64_t in,
                       const float *w, const float *bias, int64_t out, float *y,
                       int64_t y_stride)
{
    const int64_t blocks = (out + BLOCK - 1) / BLOCK;
    #pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = blocks * thread / threads, end = blocks * (thread + 1) / threads;
        for (int64_t b = first; b < end; b += GROUP) {
          const int64_t count = end - b < GROUP ? end - b : GROUP;
          for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
            const float *xr = x + r0 * x_stride;
            float *yr = y + r0 * y_stride;
            switch (rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS) {
#if TILE_ROWS == 8
            case 8: tile_group(xr, x_stride, w, bias, yr, y_stride, in, out, b, count, 8); break;
            case 7: tile_group(xr, x_stride, w, bias, yr, y_stride, in, out, b, count, 7); break;
            case 6: tile_group(xr, x_stride, w, bias, yr, y_stride, in, out, b, count, 6); break;
            case 5: tile_group(xr, x_stride, w, bias, yr, y_stride, in, out, b, count, 5); break;
#endif
            case 4: tile_group(xr, x_stride, w, bias, yr, y_stride, in, out, b, count, 4); break;
            case 3: tile_group(xr, x_stride, w, bias, yr, y_stride, in, out, b, count, 3); break;
            case 2: tile_group(xr, x_stride, w, bias, yr, y_stride, in, out, b, count, 2); break;
            default: tile_group(xr, x_stride, w, bias, yr, y_stride, in, out, b, count, 1);
            }
          }
        }
    }
}
