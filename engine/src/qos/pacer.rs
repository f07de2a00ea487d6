//! Background pacers (see below).
