"""packfwd's Triton kernels (imported only when a CUDA tensor takes a kernel path; needs Triton).

* ``gather_rows_kernel``: the row gather of ``_gather_op`` (see there).
* ``plan_rows_kernel``: a layout's per-token maps from the mask (see ``_plan_kernel``).
"""

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch these (importing this module must still work)
    triton = None

if triton is not None:
    @triton.jit(do_not_specialize=["fill"])
    def gather_rows_kernel(
        src, d1, d2, d3, d4, d5, d6, d7,  # the first source; element offsets of the others from it
        index, out, n_out, rows_per_src, n_src_rows, index_offset, fill,
        WIDTH: tl.constexpr, NSRC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        """out[r, :] = cat(srcs)[index[r] - index_offset, :] where that row exists, else ``fill`` (a word's bits)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        row_ok = rows < n_out
        k = tl.load(index + rows, mask=row_ok, other=-1).to(tl.int64) - index_offset
        keep = row_ok & (k >= 0) & (k < n_src_rows)
        k = tl.where(keep, k, 0)
        if NSRC == 1:
            base = k * WIDTH
        else:  # which source holds row k, and its element offset from the first source
            which = k // rows_per_src
            base = (k - which * rows_per_src) * WIDTH
            base += tl.where(which == 1, d1, 0)
            if NSRC > 2:
                base += tl.where(which == 2, d2, 0)
            if NSRC > 3:
                base += tl.where(which == 3, d3, 0)
            if NSRC > 4:
                base += tl.where(which == 4, d4, 0)
            if NSRC > 5:
                base += tl.where(which == 5, d5, 0)
            if NSRC > 6:
                base += tl.where(which == 6, d6, 0)
            if NSRC > 7:
                base += tl.where(which == 7, d7, 0)
        fill = (fill + tl.zeros([], dtype=tl.int64)).to(out.dtype.element_ty)  # the word's bits
        dst = out + rows.to(tl.int64)[:, None] * WIDTH + cols[None, :]
        if WIDTH % BLOCK_W == 0:  # whole blocks of columns: masks per row only
            vals = tl.load(src + base[:, None] + cols[None, :], mask=keep[:, None], other=fill)
            tl.store(dst, vals, mask=row_ok[:, None])
        else:
            col_ok = cols < WIDTH
            vals = tl.load(src + base[:, None] + cols[None, :], mask=keep[:, None] & col_ok[None, :], other=fill)
            tl.store(dst, vals, mask=row_ok[:, None] & col_ok[None, :])


    # MODE: 0 unpad, 1 THD, 2 BSHD (literals: Triton kernels read no Python globals)
    @triton.jit
    def _dest(q, start, c, local, MODE: tl.constexpr, CP: tl.constexpr):
        if MODE == 1 and CP > 1:
            k = q // tl.maximum(c, 1)
            owner = tl.where(k < CP, k, 2 * CP - 1 - k)
            return owner * local + start + tl.where(k >= CP, c, 0) + q - k * c
        return start + q

    @triton.jit
    def plan_rows_kernel(
        mask, lengths, inverse, fwd, positions, row_mask, cu, cu_padded,
        s, n_fwd, local, rank, last_row, last_extra, width, align,
        MODE: tl.constexpr, CP: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        i = tl.program_id(0)
        # Real and padded tokens of the rows before this one.
        acc_n = tl.zeros((BLOCK_B,), dtype=tl.int64)
        acc_p = tl.zeros((BLOCK_B,), dtype=tl.int64)
        for j0 in range(0, i, BLOCK_B):
            js = j0 + tl.arange(0, BLOCK_B)
            lj = tl.load(lengths + js, mask=js < i, other=0).to(tl.int64)
            acc_n += lj
            acc_p += (lj + align - 1) // align * align
        before_n = tl.sum(acc_n, 0)
        before_p = tl.sum(acc_p, 0)
        n = tl.load(lengths + i).to(tl.int64)
        if MODE == 1:
            p = (n + align - 1) // align * align + tl.where(i == last_row, last_extra, 0)
            start = before_p // CP
            c = p // (2 * CP)
        elif MODE == 2:
            p = n * 0 + width
            start = i.to(tl.int64) * width
            c = p
        else:
            p = n
            start = before_n
            c = p
        tl.store(cu + i + 1, (before_n + n).to(tl.int32))
        if MODE == 1:
            tl.store(cu_padded + i + 1, (before_p + p).to(tl.int32))
        if i == 0:
            tl.store(cu, 0)
            if MODE == 1:
                tl.store(cu_padded, 0)

        # Real tokens, in the order of the mask row.
        row = i.to(tl.int64) * s
        seen = tl.sum(tl.zeros((BLOCK_S,), dtype=tl.int64), 0)
        for c0 in range(0, s, BLOCK_S):
            cols = c0 + tl.arange(0, BLOCK_S)
            inside = cols < s
            real = tl.load(mask + row + cols, mask=inside, other=0) != 0
            ones = real.to(tl.int64)
            q = seen + tl.cumsum(ones, 0) - 1
            seen += tl.sum(ones, 0)
            dest = _dest(q, start, c, local, MODE, CP)
            real = real & (q < p) & (dest < n_fwd)  # in bounds even if the lengths were wrong
            tl.store(inverse + row + cols, tl.where(real, dest, -1), mask=inside)
            tl.store(fwd + dest, row + cols, mask=inside & real)
            if MODE == 2:
                tl.store(row_mask + dest, real, mask=inside & real)

        # The layout's padding slots, then (THD) this rank's positions.
        if MODE != 0:
            for q0 in range(0, (p - n).to(tl.int32), BLOCK_S):
                q = n + q0 + tl.arange(0, BLOCK_S)
                dest = _dest(q, start, c, local, MODE, CP)
                ok = (q < p) & (dest < n_fwd)
                tl.store(fwd + dest, -1, mask=ok)
                if MODE == 2:
                    tl.store(row_mask + dest, q < 0, mask=ok)
        if MODE == 1:
            mine = p // CP
            for u0 in range(0, mine.to(tl.int32), BLOCK_S):
                u = u0 + tl.arange(0, BLOCK_S)
                if CP == 1:
                    pos = u.to(tl.int64)
                else:
                    pos = tl.where(u < c, rank * c + u, (2 * CP - 1 - rank) * c + u - c)
                tl.store(positions + start + u, pos, mask=(u < mine) & (start + u < local))
