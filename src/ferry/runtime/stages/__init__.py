"""The runtime's stages: load, bind, schedule, run; the method and the Module that wire them."""
