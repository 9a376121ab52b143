"""A byte-level model of the head-dim-256 mixed-row copies in hqmq_decode.cu (copy_tile:
the 16-byte pieces into 64-byte slots of RAW16, and the 4-byte words into 48-byte slots;
mixed_tile_to_bits: where each half row is read back): every half row read back equals
the global one (zeros past T) for every byte offset of the rows, both halves, tile starts,
valid counts. Plain Python: `python reports/kernels/mixed_d256_copy_model.py`."""

import random
HB=45; ROW=90
def sim(path, base, T, t0, hf, trials=1):
    mem = bytes(random.randrange(256) for _ in range(base + ROW*(T+40) + 64))
    c0 = base + t0*ROW + 45*hf
    kmis = c0 & 15
    stage = bytearray(4096)
    for lane in range(32):
        if path == 16:
            for j in range(2):
                i = lane + 32*j; t, pc = i >> 2, i & 3
                ok = t0 + t < T
                ak = (10*t + kmis) & 15
                assert ((c0 + 90*t - ak) % 16) == 0
                src = c0 + ROW*t + 16*pc - ak
                n = max(0, min(16, ak + HB - 16*pc)) if ok else 0
                dst = 64*t + 16*pc
                stage[dst:dst+16] = mem[src:src+n] + bytes(16-n)
        else:
            for j in range(6):
                i = lane + 32*j; t, w = i // 12, i % 12
                ok = t0 + t < T
                ak = (2*t + kmis) & 3
                assert ((c0 + 90*t - ak) % 4) == 0
                src = c0 + ROW*t + 4*w - ak
                n = max(0, min(4, ak + HB - 4*w)) if ok else 0
                dst = 4*i
                stage[dst:dst+4] = mem[src:src+n] + bytes(4-n)
                # reading past the row end?
                assert src + n <= c0 + ROW*t + HB or not ok
    for t in range(16):
        if path == 16:
            b0 = 64*t + ((10*t + kmis) & 15)
        else:
            b0 = 48*t + ((2*t + kmis) & 3)
        got = bytes(stage[b0:b0+HB])
        want = mem[c0+ROW*t:c0+ROW*t+HB] if t0 + t < T else bytes(HB)
        assert got == want, (path, base, t0, hf, t)
random.seed(1)
for path in (16, 4):
    for base in range(0, 34):
        for hf in (0, 1):
            for t0 in (0, 16, 32, 48, 1600):
                for T in (t0+1, t0+7, t0+16, t0+100):
                    sim(path, base, T, t0, hf)
print("ok")
