"""The pure-JAX reference's answers to the kernels' known-answer test (jax_qcomm._selftest):
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
    'QSGD 2b/128 norm': ['7f537fd8084d0776', '682b16c1fa5e8f10', '96de33ef702c175b', 'f75e0a59614eff87'],
    'QSGD 3b/128 norm': ['d486f42977a0e26f', '6aaf25c55459fc1d', 'fdad744a3f38efce', 'ea58eb027f464785'],
    'QSGD 4b/128 norm': ['214916b9d47f9199', 'ba782ada296ffdcc', 'e53e50f430389094', '81aeb4517bf672b5'],
    'QSGD 5b/128 norm': ['e00addc84995b3e6', 'f858912db7ad6e9f', '482311c403f18eda', '177d89c8a6942778'],
    'QSGD 6b/128 norm': ['90e894a5d740057f', 'd6db112ce2c656c1', '0ef2fda4d11c1f02', '6df5ca0999e6c41f'],
    'QSGD 7b/128 norm': ['aad261b7dc5cc1bb', 'f287257e8e424dca', '34df60695a77a0c5', 'e462962873877920'],
    'QSGD 8b/128 norm': ['b2fc703052efeb96', 'cd237a7ea87d2afe', 'a9c952fca4861796', 'fcd4174aa47f18ac'],
    'Summable 2b/128': ['38f6efbff3a45242', 'fff4530c828cd8da', '58c2b1f353c3cd65', '9c4a7a0d8030774b'],
    'Summable 3b/128': ['38f6efbff3a45242', 'ef35f9f8e8ebfe14', 'ba7994d4e9217fad', '64cded8a36872ee0'],
    'Summable 4b/128': ['38f6efbff3a45242', 'fdf794d66bb6b137', 'c3b1dcdf8d3a15df', '795b76a1ec3d5f7e'],
    'Summable 5b/128': ['38f6efbff3a45242', '17fc4ae8e36f505b', 'be63e63feb1ca2d7', 'c2bfe3e149be0b83'],
    'Summable 6b/128': ['38f6efbff3a45242', '5912329bcd725029', 'bd7813d94a3e2e80', '02740357cc7b1651'],
    'Summable 7b/128': ['38f6efbff3a45242', '7f5cc6c2783c14dc', 'd212b188e3bf1164', '5f2c3478178ded30'],
    'Summable 8b/128': ['38f6efbff3a45242', '9dfa4b2121e51c80', '49757892f448d6a7', 'fce8d30dfc0e6373'],
}
