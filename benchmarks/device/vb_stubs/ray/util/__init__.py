"""``ray.util`` of the import-only Ray stand-in (see ray/__init__.py)."""

from .. import _no_ray

get_node_ip_address = _no_ray("util.get_node_ip_address")
placement_group = _no_ray("util.placement_group")
remove_placement_group = _no_ray("util.remove_placement_group")
list_named_actors = _no_ray("util.list_named_actors")
