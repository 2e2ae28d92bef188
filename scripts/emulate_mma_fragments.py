#!/usr/bin/env python3
"""Check the ldmatrix/mma fragment index formulas of csrc/cuda/tiles.cuh without a GPU.

Emulates one MmaTile CTA tile (128 x 128, 8 warps) in numpy: the shared-memory layout (80-byte
rows), the per-lane ldmatrix.x4 row addresses and the accumulator -> epi stores exactly as
written in MmaTile::mma_slice / compute, with the fragment layouts of the PTX ISA (ldmatrix:
lane l gets 32-bit word l % 4 of row l / 4 of each 8x8 b16 matrix; m16n8k16 and tf32 m16n8k8
A/B/C fragments), and checks the result against A @ B^T for 2-byte (bf16/fp16) and 4-byte
(tf32) elements. Keep it in sync with tiles.cuh when the tile layout changes.
"""
import numpy as np
def run(esz):
    EPC = 16 // esz; BK = 64 // esz; MK = 32 // esz; ROW = BK + EPC
    BN = BV = 128; rng = np.random.default_rng(0)
    A = rng.integers(-4, 5, (BN, BK)).astype(np.float64); B = rng.integers(-4, 5, (BV, BK)).astype(np.float64)
    sA = np.zeros((BN, ROW)); sA[:, :BK] = A; sB = np.zeros((BV, ROW)); sB[:, :BK] = B
    def ldm(s, addr_of_lane):  # returns regs[lane][i] = list of elements (a 32-bit word)
        words = EPC // 4 * 1  # elements per 32-bit word: 2 for b16, 1 for fp32
        epw = 4 // esz
        out = [[None]*4 for _ in range(32)]
        for i in range(4):
            rows = [addr_of_lane(8*i + r) for r in range(8)]
            for l in range(32):
                r, c = rows[l // 4]; w = l % 4
                out[l][i] = s[r, c + w*epw: c + w*epw + epw]
        return out
    epi = np.zeros((BN, BV + 8))
    for warp in range(8):
        wn, wv = warp % 2, warp // 2
        acc = np.zeros((4, 4, 32, 4))
        for kk in range(0, BK, MK):
            af = [ldm(sA, lambda lane, mi=mi: (wn*64 + mi*16 + lane % 16, kk + (lane // 16) * EPC)) for mi in range(4)]
            bf = {}
            for nj in range(2):
                r = ldm(sB, lambda lane, nj=nj: (wv*32 + nj*16 + lane % 8 + (lane // 16) * 8, kk + ((lane // 8) % 2) * EPC))
                bf[2*nj] = [(r[l][0], r[l][1]) for l in range(32)]
                bf[2*nj+1] = [(r[l][2], r[l][3]) for l in range(32)]
            for mi in range(4):
                for ni in range(4):
                    # rebuild the A [16, MK] and B [MK, 8] matrices from the fragments per spec
                    Am = np.full((16, MK), np.nan); Bm = np.full((MK, 8), np.nan)
                    for l in range(32):
                        g, q = l // 4, l % 4
                        a = af[mi][l]; b0, b1 = bf[ni][l]
                        if esz == 2:
                            Am[g, 2*q:2*q+2] = a[0]; Am[g+8, 2*q:2*q+2] = a[1]
                            Am[g, 2*q+8:2*q+10] = a[2]; Am[g+8, 2*q+8:2*q+10] = a[3]
                            Bm[2*q:2*q+2, g] = b0; Bm[2*q+8:2*q+10, g] = b1
                        else:
                            Am[g, q] = a[0][0]; Am[g+8, q] = a[1][0]; Am[g, q+4] = a[2][0]; Am[g+8, q+4] = a[3][0]
                            Bm[q, g] = b0[0]; Bm[q+4, g] = b1[0]
                    assert not np.isnan(Am).any() and not np.isnan(Bm).any()
                    C = Am @ Bm
                    for l in range(32):
                        g, q = l // 4, l % 4
                        acc[mi, ni, l] += [C[g, 2*q], C[g, 2*q+1], C[g+8, 2*q], C[g+8, 2*q+1]]
        for mi in range(4):
            for ni in range(4):
                for l in range(32):
                    g, q = l // 4, l % 4
                    row = wn*64 + mi*16 + g; col = wv*32 + ni*8 + 2*q
                    epi[row, col:col+2] = acc[mi, ni, l, 0:2]; epi[row+8, col:col+2] = acc[mi, ni, l, 2:4]
    ok = np.array_equal(epi[:, :BV], A @ B.T)
    print("esz", esz, "tile matches A @ B^T:", ok)

if __name__ == "__main__":
    run(2)
    run(4)
