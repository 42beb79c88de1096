"""The run config: typed frozen dataclasses (:mod:`.schema`, :mod:`.model`), YAML and ``--set`` parsing
(:mod:`.parse`) and single-field ranges (:mod:`.ranges`). Loading and the cross-layer checks live in
:mod:`jaxhybrid.runtime.config_load` and :mod:`jaxhybrid.runtime.config_checks`."""
