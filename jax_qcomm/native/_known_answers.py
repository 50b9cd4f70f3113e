"""The pure-JAX reference's answers to the kernels' known-answer test (jax_qcomm.native._selftest):
SHA-256 prefixes of every output for its fixed inputs and seed. tests/test_selftest.py checks that
the live reference still gives them; regenerate with `_selftest.reference_digests()`."""

KNOWN_ANSWERS = {
    'QSGD 1b/128 maxmin': ['96d1b804378911ac', 'f5f687026b05236c', 'cc4895251105c2b8', '0be64727c0c48894'],
    'QSGD 2b/128 maxmin': ['f1eada6584930061', 'a3cb66087ca801da', 'e074b2b56b48dbe2', 'cab6b33a76d05db2'],
    'QSGD 3b/128 maxmin': ['a41976f12ecda88f', '2637f6d95d81b06f', '421268562876bdbf', 'd9ec0136952d3473'],
    'QSGD 4b/128 maxmin': ['40292e5808f74b21', '0ff2929172c8c74d', 'e496d21d9300961e', '738a020564349c99'],
    'QSGD 5b/128 maxmin': ['107a252a12300c6f', '66c3fca7b902a495', '1936564ab7448585', '4249b28d3bc21aee'],
    'QSGD 6b/128 maxmin': ['4575988f31f59704', 'e265847b9525e412', 'b5e4bd7ca19703bb', '039128e0b7ecd897'],
    'QSGD 7b/128 maxmin': ['c60228c703d50c1e', '90497f8c936fc8e3', '2cdab022c77df1d2', '5c03890acf7526ae'],
    'QSGD 8b/128 maxmin': ['d5f6e0b6414fa843', 'e54d88a745de9651', 'b35ca7ae5e543ab8', 'aaa65ab9f6289173'],
    'QSGD 2b/128 norm': ['7f537fd8084d0776', '682b16c1fa5e8f10', 'e1bfcc4c0e96be08', 'f75e0a59614eff87'],
    'QSGD 3b/128 norm': ['d486f42977a0e26f', '6aaf25c55459fc1d', '39c4aecd3fb106d9', 'ea58eb027f464785'],
    'QSGD 4b/128 norm': ['214916b9d47f9199', 'ba782ada296ffdcc', '903395d2e60f7781', '81aeb4517bf672b5'],
    'QSGD 5b/128 norm': ['e00addc84995b3e6', 'f858912db7ad6e9f', 'ff99496684730be7', '177d89c8a6942778'],
    'QSGD 6b/128 norm': ['90e894a5d740057f', 'd6db112ce2c656c1', 'e380806004a4ebfb', '6df5ca0999e6c41f'],
    'QSGD 7b/128 norm': ['aad261b7dc5cc1bb', 'f287257e8e424dca', 'ed9afce5cd770c41', 'e462962873877920'],
    'QSGD 8b/128 norm': ['b2fc703052efeb96', 'cd237a7ea87d2afe', '8cb89354ac6738ef', 'fcd4174aa47f18ac'],
    'Summable 2b/128': ['38f6efbff3a45242', '305726f77781edf2', '4be1fa62d8a38dc8', 'fc5f9f9c4bba282b'],
    'Summable 3b/128': ['38f6efbff3a45242', '0c9e26c517dd17c4', 'f3bea52c6dd13d1b', 'ac22dea30ebc7174'],
    'Summable 4b/128': ['38f6efbff3a45242', 'd6975196780fac51', 'b30906508a0c9471', 'a3368855d157d739'],
    'Summable 5b/128': ['38f6efbff3a45242', 'b785650b5fe63fd7', 'ea13fbbe8f2c057d', 'ebad7b970203f062'],
    'Summable 6b/128': ['38f6efbff3a45242', '2de55c5ac52fd4a3', '2f9040b06f2de6f7', 'a39f14c96d052055'],
    'Summable 7b/128': ['38f6efbff3a45242', 'b7948ca4f38e3b0a', '97f454506df5d2f3', 'aeed12e5961dda13'],
    'Summable 8b/128': ['38f6efbff3a45242', '479236e476449404', '19aa0bee0a541433', '3f301d98c3e4e0f5'],
}
