//! The traffic listener's service on a worker thread.
//!
//! Proxied requests are answered right there, by `gateway::respond`: no
//! router, no extensions, no per-request span. Everything under the reserved
//! prefix (the lock API, and the 404s around it) is handed to the full axum
//! router on the store's runtime, where the store's connections live.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::response::{IntoResponse, Response};
use axum::Router;
use futures_util::future::Either;
use http::Request;
use tower::ServiceExt;

use crate::config::is_reserved;
use crate::gateway::error::GatewayError;
use crate::gateway::proxy::Downstream;
use crate::gateway::{self, GatewayState};
use crate::http1::server::{ConnInfo, HeadError, MakeService, Service};

/// One worker's traffic service.
#[derive(Clone)]
pub struct Traffic {
    /// The gateway, with this worker's upstream pool.
    pub gateway: Arc<GatewayState>,
    /// Where reserved paths go.
    pub reserved: OnRuntime,
}

impl MakeService for Traffic {
    type Service = Connection;

    fn make(&self, conn: ConnInfo) -> Connection {
        Connection {
            traffic: self.clone(),
            downstream: Downstream::new(Some(conn.peer), conn.tls.is_some()),
            conn: Arc::new(conn),
        }
    }
}

/// The service of one client connection.
pub struct Connection {
    traffic: Traffic,
    downstream: Downstream,
    /// For the reserved prefix: who the client is (the lock API's auth).
    conn: Arc<ConnInfo>,
}

impl Service for Connection {
    fn call(&self, req: Request<Body>) -> impl Future<Output = Response> + Send + 'static {
        if is_reserved(req.uri().path()) {
            let mut req = req;
            req.extensions_mut()
                .insert(ConnectInfo::<SocketAddr>(self.conn.peer));
            req.extensions_mut().insert(self.conn.clone());
            return Either::Left(self.traffic.reserved.call(req));
        }
        let (gateway, downstream) = (self.traffic.gateway.clone(), self.downstream.clone());
        Either::Right(gateway::respond(gateway, req, downstream))
    }

    fn refuse(&self, why: HeadError) -> Response {
        crate::gateway::error::refused_head(why)
    }
}

/// The router for the reserved prefix: the lock API when enabled, and a
/// problem-404 for every other path under it (no route may use the prefix).
pub fn reserved_router(locks: Option<crate::locks::api::LockApiState>) -> Router {
    let router = Router::new().fallback(no_route);
    let router = match locks {
        Some(l) => router.merge(crate::locks::api::router(l)),
        None => router,
    };
    router.method_not_allowed_fallback(crate::locks::api::method_not_allowed)
}

async fn no_route(uri: http::Uri) -> Response {
    let e = GatewayError::from(crate::gateway::error::ClientError::NoRoute {
        path: uri.path().to_string(),
    });
    e.to_problem(Duration::from_secs(1)).into_response()
}

/// Serves requests with `router` on another runtime: the one the store's
/// connections belong to.
#[derive(Clone)]
pub struct OnRuntime {
    pub runtime: tokio::runtime::Handle,
    pub router: Router,
}

impl OnRuntime {
    fn call(&self, req: Request<Body>) -> impl Future<Output = Response> + Send + 'static {
        let task = self.runtime.spawn(self.router.clone().oneshot(req));
        async move {
            match task.await {
                Ok(Ok(resp)) => resp,
                Ok(Err(never)) => match never {},
                // Only if that runtime is shutting down.
                Err(_) => GatewayError::Internal("the request's task ended early")
                    .to_problem(Duration::from_secs(1))
                    .into_response(),
            }
        }
    }
}
