#!/usr/bin/env python
"""Print every anGPT normalization factor (docs/model.md, Normalization factors) for one model shape.

    python tools/angpt_factors.py --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16
"""

import argparse

from angpt.config.choices import NU_P_READINGS

APPLIED_TO = {
    "nu_qkv": "outputs of W_q, W_k, W_v, per head (h x d): sqrt(d/h)",
    "nu_p": "output of W_p (d x d)",
    "nu_uz": "outputs of W_u and W_z (f x d): sqrt(d/f)",
    "nu_acf": "the SwiGLU product: 1 / E||u * SiLU(sqrt(d) z)||, Monte Carlo",
    "nu_d": "output of W_d (d x f): sqrt(f/d)",
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, required=True)
    parser.add_argument("--ffn-hidden-size", type=int, help="width of each of u and z (default 4 x hidden)")
    parser.add_argument("--num-attention-heads", type=int, required=True)
    parser.add_argument("--kv-channels", type=int, help="head dim (default hidden / heads)")
    parser.add_argument("--nu-p-reading", choices=NU_P_READINGS, default="one", help="default: %(default)s")
    parser.add_argument("--nu-acf-samples", type=int, default=100_000, help="default: %(default)s")
    parser.add_argument("--nu-acf-seed", type=int, default=0, help="default: %(default)s")
    args = parser.parse_args()
    if args.hidden_size % args.num_attention_heads and not args.kv_channels:
        parser.error("--hidden-size is not divisible by --num-attention-heads: give --kv-channels")
    from angpt.models.factors import derive_factors  # noqa: PLC0415 (after parsing: --help without torch)
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    factors = derive_factors(args.hidden_size, ffn, args.num_attention_heads, args.kv_channels,
                             args.nu_p_reading, args.nu_acf_samples, args.nu_acf_seed)
    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    print(f"d={args.hidden_size} f={ffn} heads={args.num_attention_heads} h={head_dim} "
          f"nu_p reading={args.nu_p_reading} nu_acf samples={args.nu_acf_samples} seed={args.nu_acf_seed}")
    for name, value in factors.as_dict().items():
        print(f"{name:<7} {value:.6f}  {APPLIED_TO[name]}")
    print("nu(alpha) 1/sqrt((1-alpha)^2 + alpha^2), recomputed from alpha every forward pass")


if __name__ == "__main__":
    main()
