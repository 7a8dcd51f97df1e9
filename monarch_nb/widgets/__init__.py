"""ipywidgets views of the mesh: ``Dashboard(mesh)`` (also ``%mesh dashboard NAME``)."""

from ._dashboard import Dashboard

__all__ = ["Dashboard"]
