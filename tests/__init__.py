"""The test suite, a package so that its sub-packages import as ``tests.kernels`` etc. and never take the bare
names of the checkout's folders (``kernels``, ``engine``) or of installed distributions."""
