//! The Warren server: configuration, the AMQP listener and connections, the cluster's glue, the HTTP
//! side, `warren ctl`. The `warren` binary (`main.rs`) is its command line; a library so that the
//! fuzz targets (`fuzz/`) can drive the HTTP router as the server builds it.

pub mod alarms;
pub mod classic_home;
pub mod cluster;
pub mod config;
pub mod connection;
pub mod ctl;
pub mod ctl_api;
pub mod http;
pub mod login_guard;
pub mod metadata_group;
pub mod powercut;
pub mod queue_members;
pub mod quorum;
pub mod server;
pub mod time_point;
pub mod tls;
