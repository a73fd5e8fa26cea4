"""The one error table names classes by their import path (it stays torch-free and boto-free):
a class that moves must move in the table too, or its errors would fall through to "unexpected"."""
import importlib

import pytest

from kubetune_api.failures import TABLE


@pytest.mark.parametrize("qualified", sorted(TABLE))
def test_every_row_of_the_error_table_names_a_class_that_exists(qualified):
    module_name, _, class_name = qualified.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    assert isinstance(cls, type) and issubclass(cls, BaseException), f"{qualified} is no exception class"
    assert f"{cls.__module__}.{cls.__qualname__}" == qualified, "the table must name the class where it is defined"
