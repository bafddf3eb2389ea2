"""The platform's tests: reprotrain/ against the real services each test starts itself."""
