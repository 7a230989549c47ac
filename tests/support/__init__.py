"""Helpers the tests share (fixtures, fakes, harness pieces); no tests here."""
