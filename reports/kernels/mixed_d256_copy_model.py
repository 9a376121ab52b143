"""A byte-level model of the head-dim-256 mixed-row copies in hqmq_decode.cu (copy_tile: the
16-byte pieces into 64-byte slots of RAW16, and the 4-byte words into 48-byte slots;
mixed_tile_to_bits: where each half row is read back): every half row read back equals the
global one (zeros past T) for every byte offset of the rows, both halves, tile starts and
valid counts. It checks the arithmetic as transcribed here, not the kernel: the GPU tests
(test_cuda_mixed_codes.py) do that. Plain Python: `python reports/kernels/mixed_d256_copy_model.py`."""
import random

HB, ROW = 45, 90  # a half row's bytes (a head dim 128 mixed row), a head dim 256 row's


def read_back(path: int, base: int, T: int, t0: int, hf: int) -> None:
    mem = bytes(random.randrange(256) for _ in range(base + ROW * (T + 40) + 64))
    c0 = base + t0 * ROW + HB * hf  # the warp's half row of the tile's first token
    mis = c0 & 15
    stage = bytearray(4096)
    for lane in range(32):
        if path == 16:  # RAW16: 2 pieces a lane, piece pc of token t from the boundary below
            for j in range(2):
                i = lane + 32 * j
                t, pc = i >> 2, i & 3
                a = (10 * t + mis) & 15
                src = c0 + ROW * t + 16 * pc - a
                assert src % 16 == 0
                n = max(0, min(16, a + HB - 16 * pc)) if t0 + t < T else 0
                stage[64 * t + 16 * pc:64 * t + 16 * pc + 16] = mem[src:src + n] + bytes(16 - n)
        else:  # 6 words a lane, word w of token t from the boundary below
            for j in range(6):
                i = lane + 32 * j
                t, w = i // 12, i % 12
                a = (2 * t + mis) & 3
                src = c0 + ROW * t + 4 * w - a
                assert src % 4 == 0
                n = max(0, min(4, a + HB - 4 * w)) if t0 + t < T else 0
                assert n == 0 or src + n <= c0 + ROW * t + HB  # nothing past the half row is read
                stage[4 * i:4 * i + 4] = mem[src:src + n] + bytes(4 - n)
    for t in range(16):
        b0 = 64 * t + ((10 * t + mis) & 15) if path == 16 else 48 * t + ((2 * t + mis) & 3)
        want = mem[c0 + ROW * t:c0 + ROW * t + HB] if t0 + t < T else bytes(HB)
        assert bytes(stage[b0:b0 + HB]) == want, (path, base, t0, hf, t)


if __name__ == "__main__":
    random.seed(1)
    for path in (16, 4):
        for base in range(34):
            for hf in (0, 1):
                for t0 in (0, 16, 32, 48, 1600):
                    for T in (t0 + 1, t0 + 7, t0 + 16, t0 + 100):
                        read_back(path, base, T, t0, hf)
    print("every half row read back as stored")
