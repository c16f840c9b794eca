"""Reports of a matrix run from pytest's junit XML alone (``python -m harness.report``).

* :mod:`.junit`: the cells' ``parity`` records read back from the XML;
* :mod:`.markdown`: the summary, GitHub annotations and the HTML page;
* :mod:`.heatmap`: worst err/tol over mesh x (dtype, switches), one PNG per component.
"""
