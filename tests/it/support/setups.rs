//! The three set-ups a fenced write's exchange is tested on: single mode on
//! SQLite, single mode on Postgres, and two shared-mode instances on one
//! Postgres database (A and B). [`on_every_setup!`] makes one test of each
//! out of a case `async fn case(setup: Setup)`.

use super::app::TestApp;
use super::db::Backend;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
    SingleSqlite,
    SinglePostgres,
    SharedPostgres,
}

impl Setup {
    /// The store the set-up runs on.
    pub fn backend(self) -> Backend {
        match self {
            Setup::SingleSqlite => Backend::Sqlite,
            Setup::SinglePostgres | Setup::SharedPostgres => Backend::Postgres,
        }
    }

    /// The set-up's in-process gateways on the store at `store_url`, with
    /// `routes` (the `[[routes]]` tables): one in single mode, A and B in
    /// shared mode.
    pub async fn spawn(self, store_url: &str, routes: &str) -> Vec<TestApp> {
        match self {
            Setup::SharedPostgres => {
                // Continues the `[store]` table that `config_text` opens.
                let extra = format!("mode = \"shared\"\n{routes}");
                vec![
                    TestApp::spawn(store_url, &extra).await,
                    TestApp::spawn(store_url, &extra).await,
                ]
            }
            _ => vec![TestApp::spawn(store_url, routes).await],
        }
    }
}

/// One test per set-up for a case `async fn $case(setup: Setup)` of the
/// calling module: a module `$case` with the tests `single_sqlite`,
/// `single_postgres` and `shared_postgres`.
macro_rules! on_every_setup {
    ($case:ident) => {
        mod $case {
            use $crate::support::setups::Setup;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn single_sqlite() {
                super::$case(Setup::SingleSqlite).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn single_postgres() {
                super::$case(Setup::SinglePostgres).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shared_postgres() {
                super::$case(Setup::SharedPostgres).await
            }
        }
    };
}
pub(crate) use on_every_setup;
