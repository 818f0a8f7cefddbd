using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Hosting;

// Crash-test host: consumes one queue with EffectConsumer under the inbox. In "block-after-commit" mode an outer
// filter, which runs after the inbox has committed and before MassTransit acknowledges, prints COMMITTED and then
// blocks forever, so the test can kill this process with SIGKILL exactly between commit and acknowledgement.
if (args.Length < 3)
{
    Console.Error.WriteLine("usage: ExactlyOnce.TestHost <block-after-commit|consume|stalling-dispatcher> <database-name> <queue> [single|batched]");
    return 2;
}

string mode = args[0];
string database = args[1];
string queue = args[2];
bool batched = args.Length > 3 && args[3] == "batched";
var probe = new ConsumerProbe();
using var host = TestHosts.Build(new TestHosts.Options
{
    Database = o => o.UseNpgsql(TestHosts.PostgresServer + ";Database=" + database),
    Services = s => s.AddSingleton(probe),
    Dispatcher = mode == "stalling-dispatcher",
    ExactlyOnce = o =>
    {
        o.Outbox.BatchSize = 50;
        o.Batching.Enabled = batched;
    },
    AfterServices = s =>
    {
        if (mode == "stalling-dispatcher")
        {
            StallingTransport.Decorate(s, publishesBeforeStall: 20);
        }
    },
    Consumers = x => x.AddConsumer<EffectConsumer>(),
    Endpoints = (context, cfg) => cfg.ReceiveEndpoint(queue, e =>
    {
        e.ConfigureConsumeTopology = false;
        if (mode == "block-after-commit")
        {
            e.UseFilter(new BlockAfterCommitFilter());
        }

        e.ConfigureConsumer<EffectConsumer>(context);
    }),
});
await host.StartAsync();
Console.WriteLine("READY");
await host.WaitForShutdownAsync();
return 0;

internal sealed class BlockAfterCommitFilter : IFilter<ConsumeContext>
{
    public async Task Send(ConsumeContext context, IPipe<ConsumeContext> next)
    {
        await next.Send(context);
        Console.WriteLine("COMMITTED " + context.MessageId);
        await Console.Out.FlushAsync();
        await Task.Delay(Timeout.Infinite);
    }

    public void Probe(ProbeContext context) => context.CreateFilterScope("blockAfterCommit");
}
