"""The test suite, a package: pytest then names a test package's modules from here (``tests.kernels...``) and puts
the checkout's root on ``sys.path``, so no folder of it stands in for an installed package of the same name."""
